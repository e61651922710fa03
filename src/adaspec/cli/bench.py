"""`adaspec bench`: decoding methods side by side on the same loaded models.

adaspec bench --suite spec-bench --limit 10 --methods ar,llamacpp,auto,ngram,draft:k=3
adaspec bench --preset quick
adaspec bench --replay bench-results/NAME --profile flat     # SIMULATED: re-priced runs
adaspec bench build-peers                                     # build llama-server once
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from adaspec.cli.model_options import add_model_options

# Plain decoding, llama.cpp's own plain loop and prompt lookup (what a CPU user has), the
# default method and two static ones. (`hf-assisted` needs torch weights: --weights none.)
DEFAULT_METHODS = "ar,llamacpp,llamacpp-lookup:k=4,auto,ngram,draft:k=3"
DEFAULTS: dict[str, Any] = {
    "suite": "spec-bench",
    "limit": None,
    "methods": DEFAULT_METHODS,
    "max_new_tokens": 128,
    "temperature": 0.0,
    "top_k": 0,
    "top_p": 1.0,
    "seed": 0,
    "repeats": 1,
}
# Presets; any option given on the command line overrides the preset's value.
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {
        # 1 Spec-Bench prompt per category (6; the MT-bench one has two turns) + 2 HumanEval
        "suite": "spec-bench:1,humaneval:2",
        "methods": DEFAULT_METHODS,
        "max_new_tokens": 48,
        "description": "spec-bench 1 prompt per category + 2 HumanEval problems, 48 new "
        f"tokens, greedy, {DEFAULT_METHODS}",
    },
}


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from adaspec.lab.bench.peer_build import LLAMA_CPP_PYTHON
    from adaspec.lab.bench.runner import METHOD_ORDERS
    from adaspec.lab.bench.suites import SUITES

    p = sub.add_parser(
        "bench",
        help="benchmark decoding methods side by side (speedup, MAT, acceptance, plots)",
        description=(
            "Run decoding methods on the same prompts in one process on the same loaded "
            "models, alternating methods prompt by prompt after a warm-up, and write a results "
            "folder: results.jsonl (one row per prompt, method and repeat, appended as it "
            "finishes), summary.json, summary.md and PNG plots."
        ),
    )
    p.add_argument(
        "--suite",
        default=None,
        help=f"prompt suite(s), comma-separated, each optionally NAME:LIMIT: {', '.join(SUITES)}"
        f" (default {DEFAULTS['suite']})",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a preset: "
        + "; ".join(f"{k}: {v['description']}" for k, v in PRESETS.items())
        + " (other options override it)",
    )
    p.add_argument(
        "--questions",
        default=None,
        metavar="PATH",
        help="data file for the suite (Spec-Bench question.jsonl, WMT prompts.json, ...)",
    )
    p.add_argument("--limit", type=int, default=None, help="prompts per category (default all)")
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated method strings (default {DEFAULT_METHODS}; `ar` always runs; "
        "see `adaspec methods`)",
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="base seed (+ repeat index), default 0")
    p.add_argument("--repeats", type=int, default=None, help="runs per prompt and method")
    p.add_argument("--out", default=None, help="results folder (default bench-results/NAME)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--method-order", choices=METHOD_ORDERS, default=METHOD_ORDERS[0],
                   help="rotate (default): each prompt starts the method list one further "
                   "along, so no method always runs first; fixed: as listed")
    p.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    p.add_argument(
        "--replay",
        default=None,
        metavar="RESULTS",
        help="run nothing: re-price the recorded steps of a results folder under --profile "
        "and report the predicted speedups (SIMULATED; written beside the results)",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="with --replay: the cost profile to price with (a JSON file from `adaspec "
        "profile`, or 'flat': simulated GPU-like costs)",
    )
    p.add_argument(
        "--head-ms",
        type=float,
        default=None,
        metavar="MS",
        help="with --replay: ms of one draft head step under that profile (for example "
        "experiments/gpu_costs.py's head_step on the GPU), for runs that drafted with the head",
    )
    p.add_argument(
        "--baseline",
        default=None,
        metavar="METHOD",
        help="also report every method's end-to-end, decode and first-token ratios to this "
        "method (one of --methods; default llama-server or llamacpp when one of them runs)",
    )
    add_model_options(p, device=True)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_bench)
    psub = p.add_subparsers(dest="bench_command", metavar="{build-peers}")
    peers = psub.add_parser(
        "build-peers",
        help="build the peers the bench compares with: llama.cpp's llama-server",
        description="Build llama-server from the llama.cpp that llama-cpp-python "
        f"{LLAMA_CPP_PYTHON} vendors (pip downloads its source), with cmake: Release, native CPU, "
        "static, only the llama-server target, into $ADASPEC_HOME/peers. A bench method "
        "that needs it builds it on first use; this builds it ahead of time.",
    )
    peers.add_argument("--force", action="store_true", help="build again even if built")
    peers.add_argument("--jobs", "-j", type=int, default=None,
                       help="parallel compile jobs (default: the cores this process may use)")
    peers.add_argument("--without-amx", action="store_true",
                       help="also build llama-server without its AMX kernels (-mno-amx-*), "
                       "which the bench runs, repacking on, where the stock build crashes on a "
                       "CPU with AMX (it builds it then on first use otherwise)")
    peers.set_defaults(func=run_build_peers)


def run_build_peers(args: argparse.Namespace) -> int:
    from adaspec.backends.weights import llama_threads
    from adaspec.lab.bench.peer_build import NO_AMX, build_info, build_server, built_server

    for variant in ("", NO_AMX) if args.without_amx else ("",):
        found = None if args.force else built_server(variant=variant)
        if found is None:
            found = build_server(force=args.force, jobs=args.jobs or llama_threads(),
                                 variant=variant)
        info = build_info(variant=variant) or {}
        name = f"llama-server ({variant} build)" if variant else "llama-server"
        print(f"{name}: {found} (llama.cpp {str(info.get('llama_cpp_commit'))[:12]} from "
              f"llama-cpp-python {info.get('llama_cpp_python')}; built in "
              f"{info.get('build_seconds', 0) / 60:.1f} min)")
    return 0


def resolve_options(args: argparse.Namespace) -> dict:
    """Command line over profile over defaults."""
    opts = dict(DEFAULTS)
    if args.preset:
        opts.update({k: v for k, v in PRESETS[args.preset].items() if k in DEFAULTS})
    for key in DEFAULTS:
        value = getattr(args, key, None)
        if value is not None:
            opts[key] = value
    return opts


def run_bench(args: argparse.Namespace) -> int:
    from adaspec.backends.device import resolve_device
    from adaspec.errors import InputError
    from adaspec.lab.bench.references import parse_bench_method
    from adaspec.lab.bench.runner import BenchConfig, check_out, normalize_methods
    from adaspec.lab.bench.suites import load_prompts, parse_suites
    from adaspec.methods.spec import split_method_list

    if args.replay is not None:
        return run_replay(args)
    if args.profile is not None:
        raise InputError("--profile prices a --replay; to run with other costs, give the "
                         "method its own profile, e.g. auto:profile=FILE")
    opts = resolve_options(args)
    device = resolve_device(args.device)  # a missing GPU is named before anything loads
    suites = parse_suites(opts["suite"], opts["limit"], args.limit is not None)
    methods = normalize_methods(split_method_list(opts["methods"]))
    specs = [parse_bench_method(m) for m in methods]
    if args.resume and args.overwrite:
        raise InputError("--resume and --overwrite exclude each other")
    name = args.preset or "-".join(n for n, _ in suites)
    config = BenchConfig(
        methods=methods,
        suites=[n if lim is None else f"{n}:{lim}" for n, lim in suites],
        max_new_tokens=opts["max_new_tokens"],
        temperature=opts["temperature"],
        top_k=opts["top_k"],
        top_p=opts["top_p"],
        seed=opts["seed"],
        repeats=opts["repeats"],
        out=args.out or f"bench-results/{name}",
        resume=args.resume,
        overwrite=args.overwrite,
        target=args.target,
        draft=args.draft,
        dtype=args.dtype,
        weights=resolve_weights(args.weights, args.target, device),
        draft_weights=resolve_weights(args.draft_weights, args.draft, device),
        device=device,
        profile=args.preset,
        limit=opts["limit"],
        method_order=args.method_order,
        baseline=args.baseline.strip() if args.baseline else None,
    )
    if config.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {config.max_new_tokens}")
    config.sampling(0)  # temperature / top-p / seed errors before loading anything
    if config.repeats < 1:
        raise InputError(f"--repeats must be >= 1, got {config.repeats}")
    prompts = load_prompts(suites, args.questions)
    if not prompts:
        raise InputError("no prompts selected: check --suite and --limit")
    if config.baseline is not None and config.baseline not in methods:
        raise InputError(f"--baseline {config.baseline!r} is not among the methods "
                         f"({', '.join(methods)}): add it to --methods")
    check_out(config)
    needs_draft = any(s.needs_draft_model() for s in specs)
    return _run(config, prompts, needs_draft, progress=not args.no_progress)


def resolve_weights(weights: str, model: str | None, device: str = "cpu") -> str:
    """`fastest` as the concrete weights it stands for on `device`, so the results record
    what ran (torch in the model's dtype on a GPU)."""
    from adaspec.backends.runtimes import fastest_weights
    from adaspec.backends.weights import FASTEST

    return fastest_weights(model, device) if weights == FASTEST and model else weights


def run_replay(args: argparse.Namespace) -> int:
    from pathlib import Path

    from adaspec.cost.profile import load_profile
    from adaspec.errors import InputError
    from adaspec.lab.bench.replay import write_replay

    if not args.profile:
        raise InputError("--replay needs --profile FILE (or --profile flat)")
    profile = load_profile(args.profile)
    name = "flat" if args.profile.strip() == "flat" else Path(args.profile).stem
    if args.head_ms is not None and not args.head_ms > 0:
        raise InputError(f"--head-ms must be a positive number of ms, not {args.head_ms}")
    path, md = write_replay(args.replay, profile, name, args.head_ms)
    print(md)
    print(f"adaspec bench: SIMULATED replay written to {path}", file=sys.stderr)
    return 0


def _llamacpp_gguf(config):
    """The target's verified GGUF when a method that runs it (`llamacpp*`, `llama-server`)
    will run, else None (a method that needs it then skips with a one-line note)."""
    from adaspec.backends.gguf import gguf_file
    from adaspec.lab.bench.references import other_weights, parse_bench_method

    wanted = any(other_weights(parse_bench_method(m)) for m in config.methods)
    return gguf_file(config.target) if wanted else None


def _run(config, prompts, needs_draft: bool, progress: bool) -> int:
    import torch

    from adaspec.backends.base import ModelBackend
    from adaspec.backends.load import load_backend, load_backends
    from adaspec.lab.bench.machine import describe_machine, measure_bandwidth
    from adaspec.lab.bench.report import to_markdown
    from adaspec.lab.bench.runner import BenchRunner

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # HF generate's per-call notices would bury the bar

    say(
        f"adaspec bench: {len(prompts)} prompts x {len(config.methods)} methods x "
        f"{config.repeats} repeat(s) -> {config.out}"
    )
    t0 = time.perf_counter()
    target, tokenizer, draft, eos = load_backends(
        config.target, config.draft if needs_draft else None, config.dtype, config.weights,
        config.draft_weights, device=config.device,
    )

    def load_variant(role: str, weights: str) -> ModelBackend:
        name = config.target if role == "target" else config.draft
        return load_backend(name, config.dtype, weights, role=role, device=config.device)[0]
    load_s = time.perf_counter() - t0
    say(f"models loaded in {load_s:.1f} s; measuring memory bandwidth")
    # where the target's weights are read: a GPU's memory, or the host's
    device = "cuda" if str(getattr(target, "device", "cpu")).startswith("cuda") else "cpu"
    machine = describe_machine(device)
    dtype = getattr(target, "dtype", torch.float32)  # a llama.cpp target (gguf) has none
    bandwidth = measure_bandwidth(dtype=dtype if dtype.is_floating_point else torch.float32,
                                  device=device)
    say(f"memory bandwidth: {bandwidth['copy_gbs']} GB/s copy, {bandwidth['gemv_gbs']} GB/s GEMV")
    runner = BenchRunner(
        config,
        target,
        tokenizer,
        draft,
        eos_token_ids=eos,
        progress=progress,
        target_gguf=_llamacpp_gguf(config),
        load_variant=load_variant,
    )
    t1 = time.perf_counter()
    summary = runner.run(  # stops the reference methods' servers when it returns or fails
        prompts,
        machine={"machine": {**machine, "model_load_s": round(load_s, 1)}, "bandwidth": bandwidth},
    )
    summary["bench_seconds"] = round(time.perf_counter() - t1, 1)
    runner.save_summary(summary)
    print(to_markdown(summary))
    ex = summary["exactness"]
    if ex["bugs"]:
        say(
            f"adaspec bench: EXACTNESS FAILURE: {ex['bugs']} output(s) differ from plain "
            "decoding by more than a numerical tie (see summary.md)"
        )
        return 1
    say(f"adaspec bench: done in {summary['bench_seconds']:.0f} s; results in {config.out}")
    return 0
