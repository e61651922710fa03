"""`adaspec osd`: online distillation of the draft (OSD), offline.

adaspec osd simulate --out results/osd             # a stream with domain shifts, replayed
adaspec osd status                                 # the adapters `serve --online-distill` saved
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from adaspec.cli.model_options import add_model_options

DEFAULT_RUNS = "frozen;online;online:domains=field;offline:0.1;offline:1"


def add_osd_parser(sub: argparse._SubParsersAction) -> None:
    from adaspec.cli.serve import add_online_options
    from adaspec.lab.osd.stream import DEFAULT_BLOCKS

    p = sub.add_parser("osd", help="OSD: replay a request stream through online distillation",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_subparsers(dest="osd_command", required=True)
    c = s.add_parser("simulate", help="replay a stream with domain shifts: frozen, online and "
                     "offline drafts side by side")
    add_model_options(c, draft=True)
    c.add_argument("--data", default=None,
                   help="the target's outputs from `adaspec s2d data` (default: its folder for "
                        "--target)")
    c.add_argument("--blocks", default=DEFAULT_BLOCKS,
                   help="blocks in stream order, SUITE[:N] each; a suite named again continues "
                        "with its next requests, so a domain can come back (e.g. "
                        f"wmt:40,humaneval:40,wmt:40; default {DEFAULT_BLOCKS})")
    c.add_argument("--per-block", type=int, default=0,
                   help="at most this many requests in a block without its own count (0: all)")
    c.add_argument("--k", type=int, default=3, help="draft tokens per step (default 3)")
    c.add_argument("--runs", default=DEFAULT_RUNS,
                   help="runs separated by ';': frozen, online[:key=value,...] (loss, sampling, "
                        f"domains, interval, steps, lr, record), offline:FRACTION (default "
                        f"{DEFAULT_RUNS!r})")
    c.add_argument("--replay", default="teacher-forced", choices=["teacher-forced", "engine"],
                   help="teacher-forced (default: one draft forward per request, the same "
                        "counts as greedy decoding) or engine (decode every request)")
    c.add_argument("--offline-steps", type=int, default=160,
                   help="optimizer steps of an offline run (default 160)")
    c.add_argument("--label-every", type=int, default=4,
                   help="--osd-domains classifier: every n-th request names its domain")
    c.add_argument("--profile", default="",
                   help="cost profile pricing the speed column (a JSON file; default: none)")
    c.add_argument("--overhead-requests", type=int, default=0,
                   help="engine replay: first measure the recorder's cost on this many requests")
    c.add_argument("--inline", action="store_true",
                   help="run updates in this process (default: the worker process serve uses)")
    c.add_argument("--out", required=True, help="results folder")
    add_online_options(c, switch=False)
    c.set_defaults(func=run_simulate)

    st = s.add_parser("status", help="the adapters saved by `adaspec serve --online-distill`")
    st.add_argument("--draft", default=None, help="the draft model (default: the built-in one)")
    st.add_argument("--osd-layers", type=int, default=2)
    st.add_argument("--osd-dir", default="")
    st.set_defaults(func=run_status)


def run_status(args: argparse.Namespace) -> int:
    from adaspec.online.adapters import adapters_root, load_all
    from adaspec.store.catalog import DRAFT_DEFAULT

    root = Path(args.osd_dir) if args.osd_dir else adapters_root(args.draft or DRAFT_DEFAULT,
                                                                 args.osd_layers)
    found = load_all(root)
    if not found:
        print(f"no adapters under {root}")
        return 0
    print(f"adapters under {root}:")
    for domain, a in sorted(found.items()):
        print(f"  {domain}: {a.updates} updates, {a.step} steps, probe agreement "
              f"{a.meta.get('probe_agreement', float('nan')):.3f}, loss {a.meta.get('loss')}")
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from adaspec.backends.weights import FASTEST, GGUF, IK
    from adaspec.errors import InputError
    from adaspec.lab.osd.simulate import parse_run, run_config
    from adaspec.lab.osd.stream import build_stream
    from adaspec.lab.s2d.data import default_data_dir
    from adaspec.online.options import online_config
    from adaspec.store.catalog import DRAFT_DEFAULT

    specs = [parse_run(t) for t in args.runs.split(";") if t.strip()]
    if not specs:
        raise InputError("--runs names no run")
    if args.k < 1:
        raise InputError(f"--k must be >= 1, got {args.k}")
    cfg = replace(online_config(args), save=False)  # a simulation saves no adapters
    for spec in specs:  # every run's settings are checked before anything loads
        run_config(cfg, spec)
    if args.replay == "engine" and args.draft_weights in (FASTEST, IK, GGUF):
        raise InputError("the engine replay trains the draft in torch: give --draft-weights "
                         "int8, int4 or none")
    draft = args.draft or DRAFT_DEFAULT
    data = Path(args.data) if args.data else default_data_dir(args.target)
    stream, meta = build_stream(data, args.blocks, args.per_block)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = {"replay": args.replay, "target": args.target, "draft": draft, "data": str(data),
             "requests": len(stream), "k": args.k, "max_new_tokens": meta["max_new_tokens"],
             "interval": cfg.interval, "loss": cfg.distill.loss,
             "sampling": cfg.distill.sampling, "layers": cfg.layers,
             "steps_per_update": cfg.distill.steps, "lr": cfg.distill.lr,
             "record": cfg.record, "top_k": cfg.top_k}
    if any(s.kind == "offline" for s in specs):
        setup["offline_steps"] = args.offline_steps
    profile = None
    if args.profile:
        from adaspec.cost.profile import load_profile

        profile = load_profile(args.profile)
    if args.replay == "engine":
        runs, tokenizer, extra = _engine_runs(args, specs, cfg, stream, meta, draft)
        setup.update(extra)
    else:
        runs, tokenizer = _teacher_forced_runs(args, specs, cfg, stream, meta, draft, out)
    from adaspec.lab.osd.report import write_results

    write_results(out, runs, stream, setup, profile, tokenizer)
    print((out / "summary.md").read_text(encoding="utf-8"))
    print(f"results in {out}", file=sys.stderr)
    return 0


def _teacher_forced_runs(args, specs, cfg, stream, meta, draft, out):
    from adaspec.backends.load import load_backend
    from adaspec.lab.osd.simulate import TargetCache, TeacherForcedReplay
    from adaspec.online.service import OnlineDistiller
    from adaspec.online.student import Student
    from adaspec.store.loading import load_model

    targets = TargetCache(out / "target_topk.pt", cfg.top_k)
    if any(r.prompt_id not in targets.rows for r in stream):
        backend, _, _ = load_backend(args.target, args.dtype, args.weights, role="target")
        try:
            targets.fill(stream, backend)
        finally:
            close = getattr(backend, "close", None)
            if callable(close):
                close()
    loaded = load_model(draft, args.dtype)
    student = Student(loaded.model, cfg.layers, cache_size=len(stream) + 16)
    needs_target = any(s.settings.get("sampling", cfg.distill.sampling) != "teacher"
                       for s in specs if s.kind == "online")
    service = OnlineDistiller(cfg, student.model, draft, args.target if needs_target else "",
                              args.weights, in_process=args.inline, wait=True)
    try:
        replay = TeacherForcedReplay(stream, student, service, targets, args.k,
                                     meta["max_new_tokens"], args.label_every,
                                     args.offline_steps)
        runs = [replay.run(spec) for spec in specs]
    finally:
        service.close()
    return runs, loaded.tokenizer


def _engine_runs(args, specs, cfg, stream, meta, draft):
    from adaspec.lab.osd.engine_replay import engine_run, recording_overhead
    from adaspec.methods.build import load_generator
    from adaspec.online.service import OnlineDistiller

    engine = load_generator(f"draft:k={args.k}", target=args.target, draft=draft,
                         dtype=args.dtype, weights=args.weights,
                         draft_weights=args.draft_weights)
    extra: dict = {"draft_weights": args.draft_weights, "target_weights": args.weights}
    if args.overhead_requests:
        extra["recording_overhead"] = recording_overhead(
            engine, stream[: args.overhead_requests], meta["max_new_tokens"], cfg.top_k)
    service = None
    if any(s.kind == "online" for s in specs):
        service = OnlineDistiller(cfg, engine.drafter.backend.model, draft, args.target,
                                  args.weights, in_process=args.inline, wait=False)
        service.check_engine(engine)
    try:
        runs = [engine_run(engine, service, stream, meta["max_new_tokens"], spec)
                for spec in specs if spec.kind != "offline"]
    finally:
        if service is not None:
            service.close()
    return runs, engine.tokenizer, extra
