"""`adaspec s2d`: build a sorted early-exit draft (S2D) and tune its exits per target.

adaspec s2d data --target qwen2.5-coder-1.5b-instruct          # the target's greedy outputs
adaspec s2d train --data DATA --name s2d-soft                  # SoFT (--mode sft: baseline)
adaspec s2d extract --data DATA --name s2d-untrained           # the untrained extraction
adaspec s2d tune s2d-soft --target qwen2.5-coder-1.5b-instruct --data DATA
adaspec generate "..." --method s2d:s2d-soft
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from adaspec.cli.model_options import add_model_options


def _exits(text: str) -> tuple[int, ...]:
    try:
        exits = tuple(int(e) for e in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"exits must be layer counts like 6,9,12: {text!r}"
                                         ) from None
    if not exits or list(exits) != sorted(set(exits)) or exits[0] < 1:
        raise argparse.ArgumentTypeError(f"exits must ascend from >= 1: {text!r}")
    return exits


def _artifact_out(args: argparse.Namespace) -> str:
    from adaspec.draft.s2d_artifact import s2d_home

    return args.out or str(s2d_home() / args.name)


def add_s2d_parser(sub: argparse._SubParsersAction) -> None:
    from adaspec.lab.s2d.data import DEFAULT_SUITES
    from adaspec.lab.s2d.train import TrainConfig

    d = TrainConfig(data="", out="")
    p = sub.add_parser("s2d", help="S2D: build, train and tune a sorted early-exit draft",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_subparsers(dest="s2d_command", required=True)

    c = s.add_parser("data", help="the target's greedy outputs on training prompts")
    add_model_options(c, draft=True)
    c.add_argument("--method", default="auto",
                   help="the exact engine that decodes (greedy: the target's own output)")
    c.add_argument("--suite", default=DEFAULT_SUITES,
                   help=f"training suites NAME:LIMIT (the prompts DESIGN.md lets train; "
                   f"default {DEFAULT_SUITES})")
    c.add_argument("--max-new-tokens", type=int, default=96)
    c.add_argument("--val-fraction", type=float, default=0.1)
    c.add_argument("--only-val", action="store_true",
                   help="only the validation prompts (for tuning thresholds on another target)")
    c.add_argument("--out", default=None,
                   help="folder (default $ADASPEC_HOME/s2d/data/TARGET); an interrupted run "
                   "resumes")
    c.add_argument("--no-progress", action="store_true")
    c.set_defaults(func=run_data)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--data", required=True, help="folder from `adaspec s2d data`")
        q.add_argument("--source", default=d.source,
                       help=f"model whose first layers become the draft (default {d.source})")
        q.add_argument("--exits", type=_exits, default=d.exits,
                       help="layer counts of the sub-models (default "
                       f"{','.join(map(str, d.exits))})")
        q.add_argument("--kept-tokens", type=int, default=d.kept_tokens,
                       help="rows of the output head: the most frequent tokens of the "
                       f"training data (0: all; default {d.kept_tokens})")
        q.add_argument("--name", default=None, help="artifact name under $ADASPEC_HOME/s2d")
        q.add_argument("--out", default=None, help="artifact folder (instead of --name)")

    e = s.add_parser("extract", help="save the untrained sorted draft (a baseline)")
    common(e)
    e.set_defaults(func=run_extract)

    t = s.add_parser("train", help="SoFT: fine-tune every exit at once (or --mode sft)")
    common(t)
    t.add_argument("--mode", choices=("soft", "sft"), default=d.mode,
                   help="soft: sum of every exit's loss; sft: the last exit's only")
    t.add_argument("--epochs", type=float, default=d.epochs)
    t.add_argument("--lr", type=float, default=d.lr)
    t.add_argument("--accumulate", type=int, default=d.accumulate,
                   help="sequences per optimizer step")
    t.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="longest training sequence (prompt tail + output)")
    t.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument("--distill", type=float, default=d.distill,
                   help="weight of a self-distillation term (KL from the source model's last "
                   "layer to each exit, every position); 0: the paper's SoFT, cross-entropy "
                   "on the target's outputs only")
    t.add_argument("--restart", action="store_true", help="ignore an existing checkpoint")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=run_train)

    u = s.add_parser("tune", help="per-target thresholds from a grid on validation prompts")
    _add_tune_arguments(u)


def _need_name(args: argparse.Namespace) -> None:
    from adaspec.errors import InputError

    if not args.out and not args.name:
        raise InputError("give the artifact a --name (under $ADASPEC_HOME/s2d) or an --out")


def run_data(args: argparse.Namespace) -> int:
    from adaspec.errors import InputError
    from adaspec.lab.bench.suites import parse_suites
    from adaspec.lab.s2d.data import collect, default_data_dir, split_of, training_prompt_pairs
    from adaspec.methods.build import load_generator

    pairs = training_prompt_pairs(parse_suites(args.suite, None, False))
    if args.only_val:
        pairs = [(s, p) for s, p in pairs if split_of(p.id, args.val_fraction) == "val"]
    if not pairs:
        raise InputError("no training prompts selected: check --suite")
    out = args.out or str(default_data_dir(args.target))
    engine = load_generator(args.method, args.target, args.draft, args.dtype, args.weights,
                         args.draft_weights)
    print(f"adaspec s2d data: {len(pairs)} prompts, greedy, {args.max_new_tokens} new tokens "
          f"-> {out}", file=sys.stderr)
    target: Any = getattr(engine, "target", engine)  # a backend: it has a name
    collect(pairs, engine, str(target.name), out,
            args.max_new_tokens, args.method, args.val_fraction, progress=not args.no_progress)
    print(f"adaspec s2d data: done; train with `adaspec s2d train --data {out} --name NAME`",
          file=sys.stderr)
    return 0


def run_extract(args: argparse.Namespace) -> int:
    from adaspec.lab.s2d.train import extract_only

    _need_name(args)
    out = extract_only(args.source, args.exits, args.data, args.kept_tokens, _artifact_out(args))
    print(f"adaspec s2d extract: {out}", file=sys.stderr)
    return 0


def run_train(args: argparse.Namespace) -> int:
    from adaspec.lab.s2d.train import TrainConfig, train

    _need_name(args)
    cfg = TrainConfig(
        data=args.data, out=_artifact_out(args), source=args.source, exits=args.exits,
        mode=args.mode, kept_tokens=args.kept_tokens, epochs=args.epochs, lr=args.lr,
        accumulate=args.accumulate, max_tokens=args.max_tokens,
        checkpoint_every=args.checkpoint_every, seed=args.seed, distill=args.distill,
    )
    out = train(cfg, resume=not args.restart, progress=not args.no_progress)
    print(f"adaspec s2d train: {out}; tune it with `adaspec s2d tune {out} --target T "
          "--data DATA`", file=sys.stderr)
    return 0


def _add_tune_arguments(p: argparse.ArgumentParser) -> None:
    from adaspec.lab.s2d.tune import DEFAULT_GRID, run_tune

    p.add_argument("artifact", help="the sorted draft (folder or name under $ADASPEC_HOME/s2d)")
    add_model_options(p, draft=False)
    p.add_argument("--data", required=True,
                   help="this target's greedy outputs (`adaspec s2d data --target ...`); "
                   "its validation rows are used")
    p.add_argument("--k", default="1,2,3,4,5", help="draft lengths to try (default 1,2,3,4,5)")
    p.add_argument("--grid", default=",".join(map(str, DEFAULT_GRID)),
                   help="threshold values per exit (1.01: never stop there)")
    p.add_argument("--profile", default=None, metavar="FILE|flat|linear:...",
                   help="prices the target's verification (default: this machine's, measured "
                   "once and cached); a formula is simulated and is stored as such")
    p.add_argument("--limit", type=int, default=None, help="validation rows to use")
    p.add_argument("--draft-weights", default="bfloat16",
                   choices=("bfloat16", "float32", "int8", "int4"),
                   help="the sorted draft's weights, as the method's dtype= (default bfloat16)")
    p.add_argument("--report", default=None, help="also write the whole grid to this JSON")
    p.add_argument("--no-store", action="store_true",
                   help="print the best setting, do not write it to the artifact")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_tune)
