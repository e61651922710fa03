"""`adaspec router`: collect offline data, record prompt states, train the policy, report.

adaspec router collect --suite sharegpt:8,humaneval:4,wmt:4 --out router-data
adaspec router cv router-data --alphas 0,0.1,0.5
adaspec router train router-data --out router.pt [--profile FILE|flat]
adaspec bench --suite spec-bench:2 --methods ar,ngram,draft:k=4,router:router.pt
adaspec router features --suite spec-bench:2 --out router-test
adaspec router report --train router-data --bench bench-results/x --features router-test
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from adaspec.cli.model_options import add_model_options

COLLECT_SUITES = "sharegpt:8,humaneval:4,wmt:4"
ALPHAS = "0,0.1,0.25,0.5,0.75,1"


def _model_args(p: argparse.ArgumentParser) -> None:
    """The shared model options, plus the progress switch both model-loading commands take."""
    add_model_options(p)  # the fastest weights: ik_llama.cpp gives prompt states too
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _train_args(p: argparse.ArgumentParser) -> None:
    from adaspec.lab.router.reward import COSTS, DEFAULT_COST
    from adaspec.route.policy import TrainConfig

    d = TrainConfig()
    p.add_argument("--alpha", type=float, default=None, help="reward = alpha * Rouge-L + "
                   "(1 - alpha) * cost (default: see `adaspec router train -h`)")
    p.add_argument("--cost", choices=COSTS, default=None,
                   help="measured: t_best / t_arm per prompt on this machine; profile: the "
                   "same with each arm's recorded steps priced by --profile; params: the "
                   f"paper's 1 - e^(p_i - p_max) (default: profile with --profile, else "
                   f"{DEFAULT_COST})")
    p.add_argument("--profile", default=None, metavar="FILE|flat|linear:...",
                   help="cost profile that prices the arms' recorded steps for the profile "
                   "cost: a JSON file (`adaspec profile --out FILE`) or a formula ('flat': "
                   "simulated GPU-like costs)")
    p.add_argument("--epochs", type=int, default=d.epochs, help=f"default {d.epochs}")
    p.add_argument("--lr", type=float, default=d.lr, help=f"AdamW, default {d.lr}")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--hidden", type=int, default=d.hidden, help="MLP width")
    p.add_argument("--seed", type=int, default=d.seed)


def _cv_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--folds", type=int, default=4, help="k-fold over prompts (default 4)")
    p.add_argument("--alphas", default=ALPHAS, help=f"alphas to compare (default {ALPHAS})")


def add_router_parser(sub: argparse._SubParsersAction) -> None:
    from adaspec.methods.arms import DEFAULT_ARMS

    p = sub.add_parser(
        "router",
        help="the context-aware draft router: collect data, train the policy, report",
        description="A policy trained offline picks the decoding method per request from the "
        "target's prompt state (Huang et al.). Use a trained artifact with "
        "`adaspec generate --router FILE` or the bench method router:FILE.",
    )
    rsub = p.add_subparsers(dest="router_command", required=True)

    c = rsub.add_parser("collect", help="run every arm on training prompts; record the data")
    c.add_argument("--suite", default=COLLECT_SUITES, help="training suites NAME:LIMIT (limit "
                   "per category, from the prompts DESIGN.md lets train: ShareGPT below 12,000, "
                   f"HumanEval 0-59, WMT, Spec-Bench's odd ids; default {COLLECT_SUITES})")
    c.add_argument("--arms", default=None, help="comma-separated method strings or a JSON "
                   f"config {{\"arms\": {{name: method}}}} (default {','.join(DEFAULT_ARMS)})")
    c.add_argument("--out", default="router-data", help="collection folder (resumable)")
    c.add_argument("--max-new-tokens", type=int, default=48)
    c.add_argument("--sample-temperature", type=float, default=1.0,
                   help="temperature of plain decoding's sampled output (its similarity)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--overwrite", action="store_true", help="start the collection over")
    _model_args(c)
    c.set_defaults(func=run_collect)

    f = rsub.add_parser("features", help="record prompt states only (for test prompts)")
    f.add_argument("--suite", required=True, help="suites NAME:LIMIT, as `adaspec bench` "
                   "takes them (the same first prompts)")
    f.add_argument("--out", required=True)
    _model_args(f)
    f.set_defaults(func=run_features, draft=None)

    t = rsub.add_parser("train", help="train the policy with REINFORCE; write the artifact")
    t.add_argument("data", help="folder from `adaspec router collect`")
    t.add_argument("--out", default="router.pt", help="artifact file")
    t.add_argument("--limit", type=int, default=None, help="use the first N prompts only")
    t.add_argument("--alpha-cv", action="store_true", help="choose alpha among --alphas by "
                   "k-fold cross-validation on the training prompts (overrides --alpha)")
    _cv_args(t)
    _train_args(t)
    t.set_defaults(func=run_train)

    v = rsub.add_parser("cv", help="cross-validate alpha on the training prompts (no test set)")
    v.add_argument("data", help="folder from `adaspec router collect`")
    v.add_argument("--out", default=None, help="also write the table as JSON")
    _cv_args(v)
    _train_args(v)
    v.set_defaults(func=run_cv)

    r = rsub.add_parser("report", help="router vs arms vs oracle, learning curve, alpha sweep")
    r.add_argument("--train", required=True, help="folder from `adaspec router collect`")
    r.add_argument("--bench", required=True, help="bench results folder with the arms and "
                   "router methods on the test prompts")
    r.add_argument("--features", required=True, help="folder from `adaspec router features` "
                   "on the same test prompts")
    r.add_argument("--out", required=True, help="report folder (report.md, report.json, PNGs)")
    r.add_argument("--alphas", default=ALPHAS, help="alpha sweep")
    r.add_argument("--draws", type=int, default=5, help="random training subsets per size")
    _train_args(r)
    r.set_defaults(func=run_report)


def _load(args: argparse.Namespace, need_draft: bool):
    from transformers.utils import logging as hf_logging

    from adaspec.backends.load import load_backends

    hf_logging.set_verbosity_error()
    return load_backends(
        args.target, args.draft if need_draft else None, args.dtype, args.weights,
        args.draft_weights,
    )


def _suites(text: str):
    from adaspec.lab.bench.suites import parse_suites

    return parse_suites(text, None, False)


def run_collect(args: argparse.Namespace) -> int:
    from adaspec.errors import InputError
    from adaspec.lab.bench.suites import training_prompts
    from adaspec.lab.router.collect import CollectConfig, collect
    from adaspec.methods.arms import parse_arms
    from adaspec.methods.spec import parse_method

    arms = parse_arms(args.arms)
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompts = training_prompts(_suites(args.suite))
    if not prompts:
        raise InputError("no training prompts selected: check --suite")
    need_draft = any(parse_method(m).needs_draft_model() for m in arms.values())
    target, tokenizer, draft, eos = _load(args, need_draft)
    print(f"adaspec router collect: {len(prompts)} prompts x {len(arms)} arms -> {args.out}",
          file=sys.stderr)
    config = CollectConfig(
        arms=arms, out=args.out, max_new_tokens=args.max_new_tokens,
        sample_temperature=args.sample_temperature, seed=args.seed, overwrite=args.overwrite,
        dtype=args.dtype,
        weights=(args.weights, args.draft_weights),
    )
    collect(config, prompts, target, tokenizer, draft, eos, progress=not args.no_progress)
    print(f"adaspec router collect: done; train with `adaspec router train {args.out}`",
          file=sys.stderr)
    return 0


def run_features(args: argparse.Namespace) -> int:
    from adaspec.lab.bench.suites import load_prompts
    from adaspec.lab.router.collect import record_states
    from adaspec.methods.build import build_generator

    prompts = load_prompts(_suites(args.suite), None)
    target, tokenizer, _, eos = _load(args, False)
    engine = build_generator("ar", target, tokenizer, None, eos)
    rows = record_states(prompts, engine, Path(args.out), progress=not args.no_progress)
    print(f"adaspec router features: {len(rows)} prompt states in {args.out}", file=sys.stderr)
    return 0


def _cost(args: argparse.Namespace):
    """(cost, profile): --cost defaults to profile when a profile is given."""
    from adaspec.errors import InputError
    from adaspec.lab.router.reward import DEFAULT_COST

    cost = args.cost or ("profile" if args.profile else DEFAULT_COST)
    if cost == "profile" and not args.profile:
        raise InputError("--cost profile prices each arm's recorded steps with a cost profile: "
                         "give --profile FILE|flat (`adaspec profile --out FILE` measures one)")
    profile = None
    if args.profile:
        from adaspec.cost.profile import load_profile

        profile = load_profile(args.profile)
    args.cost = cost
    return cost, profile


def _training_data(args: argparse.Namespace, profile):
    from adaspec.lab.router.collection import load_collection

    data = load_collection(args.data)
    return data.with_profile(profile) if profile is not None else data


def train_config(args: argparse.Namespace):
    from adaspec.route.policy import TrainConfig

    cfg = TrainConfig(
        lr=args.lr, weight_decay=args.weight_decay, batch_size=args.batch_size,
        epochs=args.epochs, hidden=args.hidden, seed=args.seed,
    )
    cfg.check()
    return cfg


def run_train(args: argparse.Namespace) -> int:
    from adaspec.errors import InputError
    from adaspec.lab.router.evaluate import choose_alpha
    from adaspec.lab.router.train_policy import DEFAULT_ALPHA, train_artifact

    config = train_config(args)  # bad settings fail before any data is read
    _, profile = _cost(args)
    data = _training_data(args, profile)
    if args.limit is not None:
        if args.limit < 1:
            raise InputError(f"--limit must be >= 1, got {args.limit}")
        data = data.subset(range(min(args.limit, len(data))))
    alpha = DEFAULT_ALPHA if args.alpha is None else args.alpha
    cv = None
    if args.alpha_cv:
        alpha, cv = choose_alpha(data, _alphas(args.alphas), args.cost, config, args.folds)
        _print_cv(cv, len(data), args.cost, config.epochs)
    art = train_artifact(data, alpha, args.cost, config)
    if cv is not None:
        art.info["cv"] = cv
    from adaspec.route.artifact import save_artifact

    save_artifact(art, args.out)
    info = art.info
    priced = f" ({data.profile_source})" if args.cost == "profile" else ""
    print(f"trained on {len(data)} prompts, arms {art.arm_names}, alpha {alpha}, cost "
          f"{args.cost}{priced}: expected reward {info['history'][-1]['reward']:.3f}; greedy "
          f"picks {info['train_choices']} -> {args.out}")
    return 0


def _alphas(text: str) -> list[float]:
    from adaspec.errors import InputError

    try:
        alphas = [float(a) for a in text.split(",") if a.strip()]
    except ValueError:
        raise InputError(f"--alphas must be comma-separated numbers, got {text!r}") from None
    if not alphas:
        raise InputError("--alphas is empty")
    return alphas


def _print_cv(rows: list[dict], prompts: int, cost: str, epochs: int) -> None:
    print(f"{rows[0]['folds']}-fold cross-validation on {prompts} training prompts, cost "
          f"{cost}, epochs {epochs} (speedup over plain decoding, replayed)")
    print(f"{'alpha':>6} {'mean over categories':>21} {'overall':>8} {'fastest':>8}  picks")
    for r in rows:
        print(f"{r['alpha']:>6} {r['mean_speedup']:>20.2f}x {r['speedup']:>7.2f}x "
              f"{r['fastest_share']:>8.0%}  {r['picks']}")


def run_cv(args: argparse.Namespace) -> int:
    from adaspec.lab.router.evaluate import cross_validate

    config, alphas = train_config(args), _alphas(args.alphas)
    _, profile = _cost(args)
    data = _training_data(args, profile)
    rows = cross_validate(data, alphas, args.cost, config, args.folds)
    _print_cv(rows, len(data), args.cost, config.epochs)
    if args.out:
        from adaspec.store.atomic import write_json

        write_json(args.out, rows)
    return 0


def run_report(args: argparse.Namespace) -> int:
    from adaspec.errors import InputError
    from adaspec.lab.router.router_report import write_report

    alphas = _alphas(args.alphas)
    if args.draws < 1:
        raise InputError("--draws must be >= 1")
    alpha = None if args.alpha is None else args.alpha
    cost, profile = _cost(args)
    out = write_report(
        args.train, args.bench, args.features, args.out, train_config(args), cost,
        alpha, alphas, args.draws, profile,
    )
    print(f"adaspec router report: {out}")
    return 0
