"""`adaspec disco`: collect training data, train the classifier, tune tau and SL_max by
latency, and bench DISCO against its baselines on the test split.

adaspec disco collect --suite humaneval:20,spec-bench:5 --out disco/data.pt
adaspec disco train --data disco/data.pt --suite humaneval --out disco/humaneval.pt
adaspec disco tune --artifact disco/humaneval.pt --data disco/data.pt [--profile FILE|machine]
adaspec disco bench --data disco/data.pt --artifacts disco/humaneval.pt,disco/spec-bench.pt \
    [--stop-cost --profile FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

from adaspec.cli.model_options import add_model_options

# tune and bench load the pair an artifact was trained for, with its weights, unless told
ARTIFACT_PAIR = "the artifact"
MACHINE = "machine"  # `disco tune --profile machine`: this machine's cached cost profile


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def add_disco_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "disco",
        help="DISCO dynamic speculation length: collect, train, tune, bench",
        description="Train and evaluate DISCO's stop/continue classifier for a draft/target pair.",
    )
    cmds = p.add_subparsers(dest="disco_command", required=True)
    _add_collect(cmds)
    _add_train(cmds)
    _add_tune(cmds)
    _add_bench(cmds)


def _add_collect(cmds: argparse._SubParsersAction) -> None:
    """`adaspec disco collect`: target outputs and teacher-forced draft features."""
    c = cmds.add_parser("collect", help="target greedy outputs + teacher-forced draft features")
    c.add_argument("--suite", default="humaneval:20,spec-bench:5", help="NAME:LIMIT per category")
    c.add_argument("--questions", default=None, metavar="PATH", help="Spec-Bench question file")
    c.add_argument("--max-new-tokens", type=int, default=64)
    c.add_argument("--split", default="0.6,0.2,0.2", help="train,val,test fractions per category")
    c.add_argument("--seed", type=int, default=0, help="shuffles prompts before splitting")
    c.add_argument(
        "--method",
        default="ngram",
        help="exact engine that produces the target's greedy output (default ngram: the same "
        "tokens as plain decoding, cheaper)",
    )
    c.add_argument(
        "--exclude",
        default=None,
        metavar="DATA[,DATA]",
        help="leave out the prompts of these data files: with --split 0,0,1 this collects "
        "held-out test prompts for artifacts trained on them",
    )
    add_model_options(c, default_weights="none")
    c.add_argument("--out", required=True, help="data file to write (.pt)")
    c.add_argument("--no-progress", action="store_true")
    c.set_defaults(func=cmd_collect)


def _add_train(cmds: argparse._SubParsersAction) -> None:
    """`adaspec disco train`: the classifier, F1 on the validation split."""
    t = cmds.add_parser("train", help="train the classifier on the train split; F1 on val")
    t.add_argument("--data", required=True)
    t.add_argument("--suite", default=None, help="train on these suites (default: all in data)")
    t.add_argument("--out", required=True, help="artifact file to write (.pt)")
    t.add_argument("--hidden", type=int, default=32)
    t.add_argument("--epochs", type=int, default=400)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--top-k", type=int, default=10, help="top draft probabilities to read")
    t.add_argument(
        "--generation-position",
        action="store_true",
        help="also read the position in the generation",
    )
    t.set_defaults(func=cmd_train)


def _add_tune(cmds: argparse._SubParsersAction) -> None:
    """`adaspec disco tune`: tau and SL_max by simulated latency."""
    u = cmds.add_parser("tune", help="choose tau and SL_max on val by measured-cost latency")
    u.add_argument("--artifact", required=True, help="artifact from train (updated in place)")
    u.add_argument("--data", required=True)
    u.add_argument("--suite", default=None, help="val suites (default: the training suites)")
    add_model_options(u, weights=False, default_from=ARTIFACT_PAIR)
    u.add_argument("--repeats", type=int, default=5, help="timing repeats per forward size")
    u.add_argument(
        "--costs-from",
        default=None,
        metavar="ARTIFACT",
        help="reuse the per-forward costs measured while tuning another artifact of this pair",
    )
    u.add_argument(
        "--profile",
        default=None,
        metavar="FILE|flat|linear:...|machine",
        help="price the simulation with a cost profile instead of timing forwards now: a JSON "
        "file (`adaspec profile --out FILE`), a formula, or `machine` (this machine's cached "
        "profile of the artifact's pair, measured on first use)",
    )
    u.add_argument("--sl-max", type=int, default=8, help="largest SL_max (and static k) tried")
    u.add_argument(
        "--confirm",
        type=int,
        default=0,
        metavar="N",
        help="re-run the N best simulated settings for real on the val prompts",
    )
    u.set_defaults(func=cmd_tune)


def _add_bench(cmds: argparse._SubParsersAction) -> None:
    """`adaspec disco bench`: DISCO against its baselines on the test split."""
    b = cmds.add_parser("bench", help="DISCO and its baselines on the test split, one run")
    b.add_argument("--data", required=True)
    b.add_argument("--artifacts", required=True, help="comma-separated tuned artifacts")
    b.add_argument("--out", required=True, help="results folder")
    b.add_argument("--max-new-tokens", type=int, default=48)
    b.add_argument(
        "--limit",
        default=None,
        metavar="N|CATEGORY:N,...",
        help='test prompts per category: one count, per-category counts, or both ("2,rag:1")',
    )
    b.add_argument("--static-sweep", action="store_true", help="also run draft:k=1..8")
    b.add_argument(
        "--stop-cost",
        action="store_true",
        help="also run DISCO's cost rule (stop=cost) per artifact, with its tuned cap and guess",
    )
    b.add_argument(
        "--profile",
        default=None,
        metavar="FILE|flat",
        help="the cost profile of --stop-cost (default: this machine's, measured on first use)",
    )
    add_model_options(b, weights=False, default_from=ARTIFACT_PAIR)
    b.add_argument("--questions", default=None, metavar="PATH", help="Spec-Bench question file")
    b.add_argument("--resume", action="store_true")
    b.add_argument("--overwrite", action="store_true")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=cmd_bench)

def _suites_arg(text: str | None, default: list[str]) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()] if text else default


# ------------------------------------------------------------------------- collect
def _excluded_prompts(paths: str | None) -> set[tuple[str, str]]:
    """(suite, prompt id) of every sample in the comma-separated data files."""
    from adaspec.lab.disco.dataset import DiscoData

    out: set[tuple[str, str]] = set()
    for path in (p.strip() for p in (paths or "").split(",")):
        if path:
            out |= {(s.suite, s.prompt_id) for s in DiscoData.load(path).samples}
    return out


def cmd_collect(args: argparse.Namespace) -> int:
    from adaspec.backends.load import load_backends
    from adaspec.core.sampling import SamplingParams
    from adaspec.errors import InputError
    from adaspec.lab.bench.suites import load_suite, parse_suites
    from adaspec.lab.disco.dataset import assign_splits, collect
    from adaspec.methods.build import build_generator
    from adaspec.methods.spec import parse_method

    try:
        fractions = [float(x) for x in args.split.split(",")]
    except ValueError:
        raise InputError(f"--split must be three numbers, got {args.split!r}") from None
    if args.max_new_tokens < 2:
        raise InputError("--max-new-tokens must be >= 2")
    spec = parse_method(args.method)
    suites = parse_suites(args.suite, None, False)
    prompts = []
    for name, limit in suites:
        path = args.questions if name == "spec-bench" else None
        prompts += [(name, p) for p in load_suite(name, limit, path)]
    excluded = _excluded_prompts(args.exclude)
    prompts = [(name, p) for name, p in prompts if (name, p.id) not in excluded]
    if not prompts:
        raise InputError(f"no prompts left in {args.suite} once --exclude is applied")
    splits = assign_splits(prompts, fractions, args.seed)
    target, tokenizer, draft, eos = load_backends(
        args.target, args.draft, args.dtype, args.weights, args.draft_weights
    )
    assert draft is not None
    engine = build_generator(spec, target, tokenizer, draft, eos_token_ids=eos)

    def generate(prompt):
        res = engine.generate(prompt.text, args.max_new_tokens, SamplingParams())
        return res.prompt_ids, res.token_ids

    say(f"disco collect: {len(prompts)} prompts, {args.max_new_tokens} tokens, via {spec.text}")
    data = collect(
        prompts,
        generate,
        draft,
        splits,
        provenance={
            "target": target.name,
            "draft": draft.name,
            "dtype": args.dtype,
            "weights": args.weights,
            "draft_weights": args.draft_weights,
            "suites": [f"{n}:{lim}" if lim is not None else n for n, lim in suites],
            "questions": args.questions,
            "max_new_tokens": args.max_new_tokens,
            "generated_with": spec.text,
            "split_fractions": fractions,
            "split_seed": args.seed,
            "excluded": args.exclude,
        },
        progress=not args.no_progress,
    )
    data.save(args.out)
    counts = {n: len(data.split(n)) for n in ("train", "val", "test")}
    tokens = data.provenance["tokens"]
    hits = sum(int(s.hits.sum()) for s in data.samples)
    say(
        f"wrote {args.out}: {len(data.samples)} prompts {counts}, "
        f"{tokens} tokens, draft hit rate {hits / max(1, tokens):.1%}, "
        f"{data.provenance['collect_seconds']} s"
    )
    return 0


# --------------------------------------------------------------------------- train
def cmd_train(args: argparse.Namespace) -> int:
    from adaspec.control.disco_features import FeatureSpec
    from adaspec.lab.disco.dataset import DiscoData
    from adaspec.lab.disco.train_classifier import train_artifact

    data = DiscoData.load(args.data)
    suites = _suites_arg(args.suite, data.suites)
    spec = FeatureSpec.from_dict(
        {"top_k": args.top_k, "generation_position": args.generation_position}
    )
    art = train_artifact(data, suites, spec, args.hidden, args.epochs, args.seed)
    art.save(args.out)
    m = art.metrics
    v = m["val"]
    say(
        f"trained on {m['train_rows']} rows of {', '.join(suites)} (accept rate "
        f"{m['train_accept_rate']:.1%}); best epoch {m['best_epoch']}/{m['epochs']}"
    )
    print(
        f"validation ({v['rows']} rows): classifier F1 {v['classifier']['f1_macro']:.3f} "
        f"(accept {v['classifier']['f1_accept']:.3f}, reject {v['classifier']['f1_reject']:.3f}) "
        f"vs best static k={v['static_k']} F1 {v['static']['f1_macro']:.3f} "
        f"(accept {v['static']['f1_accept']:.3f}, reject {v['static']['f1_reject']:.3f})"
    )
    say(f"wrote {args.out} (tau {art.tau}, SL_max {art.sl_max} until `adaspec disco tune`)")
    return 0


# ---------------------------------------------------------------------------- tune
def cmd_tune(args: argparse.Namespace) -> int:
    from adaspec.control.disco_artifact import DiscoArtifact
    from adaspec.errors import InputError
    from adaspec.lab.disco.dataset import DiscoData
    from adaspec.lab.disco.simulate import ORACLE_CAP, Costs
    from adaspec.lab.disco.train_classifier import select
    from adaspec.lab.disco.tune import measure_step_costs, measured_run, tune_artifact

    art = DiscoArtifact.load(args.artifact)
    data = DiscoData.load(args.data)
    suites = _suites_arg(args.suite, art.provenance.get("train_suites") or data.suites)
    val = select(data, "val", suites)
    if not val:
        raise InputError(f"no validation prompts for {suites} in {args.data}")
    if args.sl_max < 1 or args.repeats < 1 or args.confirm < 0:
        raise InputError("--sl-max and --repeats must be >= 1, --confirm >= 0")
    if args.costs_from and args.profile:
        raise InputError("--costs-from and --profile are two sources of costs: give one")
    costs = run = None
    priced_to = max(args.sl_max, ORACLE_CAP)  # the longest step any tuned setting drafts
    if args.profile and args.profile != MACHINE:
        from adaspec.cost.profile import load_profile

        profile = load_profile(args.profile)
        costs = Costs.from_profile(profile, priced_to)
        say(f"costs from the cost profile {args.profile}"
            + (" (simulated, not measured)" if profile.simulated else ""))
    if args.costs_from:
        source = DiscoArtifact.load(args.costs_from)
        source.check_pair(art.target, art.draft)
        if not source.tuning.get("costs"):
            raise InputError(f"{args.costs_from} holds no measured costs: tune it first")
        costs = Costs(**source.tuning["costs"])
        say(f"costs measured while tuning {args.costs_from}")
    if costs is None or args.confirm:
        from adaspec.backends.load import load_backends

        target, tokenizer, draft, eos = load_backends(
            args.target or art.target, args.draft or art.draft, args.dtype, *art.weights
        )
        assert draft is not None
        art.check_pair(target.name, draft.name)
        if costs is None and args.profile == MACHINE:
            from adaspec.cost.cache import profile_for
            from adaspec.engine.overhead import loop_overhead_ms

            measured = profile_for(target, draft, tokenizer, loop_overhead=loop_overhead_ms)
            costs = Costs.from_profile(measured, priced_to)
            say("costs from this machine's cost profile")
        if costs is None:
            costs = measure_step_costs(art, val, target, draft, args.sl_max, args.repeats, say)
        run = measured_run(art, val, target, tokenizer, draft, eos)
    result = tune_artifact(art, val, costs, args.sl_max, args.confirm, run, say)
    art.save(args.artifact)
    b = result["best"]
    print(json.dumps({k: b[k] for k in ("disco", "static", "confidence", "disco-cost")}, indent=1))
    c = b["disco-cost"]
    say(
        f"tuned on {len(val)} val prompts: tau {art.tau}, SL_max {art.sl_max} "
        f"(simulated {b['disco']['ms_per_token']:.0f} ms/token; cost rule, cap {c['sl_max']}, "
        f"guess {c['guess']}: {c['ms_per_token']:.0f}; best static k="
        f"{b['static']['sl_max']} {b['static']['ms_per_token']:.0f}; plain "
        f"{result['ar_ms_per_token']:.0f}); wrote {args.artifact}"
    )
    return 0


# --------------------------------------------------------------------------- bench
def cmd_bench(args: argparse.Namespace) -> int:
    from adaspec.lab.disco.compare import run_disco_bench

    return run_disco_bench(args, log=say)
