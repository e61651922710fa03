"""`adaspec generate`: one prompt through the speculative engine, then a stats line."""

from __future__ import annotations

import argparse
import json
import sys

from adaspec.cli.model_options import add_model_options
from adaspec.core.sampling import SamplingParams
from adaspec.methods.spec import DEFAULT_METHOD


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate an answer speculatively (default: the built-in Qwen2.5-Coder pair)",
        description="Generate the target model's answer to PROMPT with speculative decoding.",
    )
    p.add_argument("prompt", help="the user message (a chat template is applied unless --raw)")
    p.add_argument(
        "--method",
        default=DEFAULT_METHOD,
        help=f"decoding method (default {DEFAULT_METHOD}; see `adaspec methods`)",
    )
    add_model_options(p, device=True)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print the full per-request stats as JSON")
    p.add_argument(
        "--router",
        default=None,
        metavar="ARTIFACT",
        help="let a trained router (adaspec router train) pick the method; replaces --method",
    )
    p.add_argument("--router-mode", default="greedy", choices=["greedy", "dynamic"])
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from adaspec.backends.device import resolve_device
    from adaspec.engine.steps import GenerationResult, StreamChunk
    from adaspec.errors import InputError
    from adaspec.methods.build import load_generator
    # Check everything the user typed before spending seconds on loading models.
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if args.router is not None:
        args.method = f"router:{args.router},mode={args.router_mode}"
    _check_method(args.method)
    if not args.prompt.strip():
        raise InputError("prompt is empty: give some text to continue")
    resolve_device(args.device)  # a missing GPU is named before any model loads
    engine = load_generator(
        args.method, args.target, args.draft, args.dtype, args.weights, args.draft_weights,
        args.device,
    )
    result: GenerationResult | None = None
    for item in engine.stream(
        args.prompt, args.max_new_tokens, sampling, args.stop, chat=not args.raw
    ):
        if isinstance(item, StreamChunk):
            if args.stream:
                sys.stdout.write(item.text)
                sys.stdout.flush()
        else:
            result = item
    assert result is not None
    if args.stream:
        sys.stdout.write("\n")
    else:
        print(result.text)
    routed = ""
    if result.stats.route is not None:
        routed = f" | routed to {result.stats.route} in {1000 * result.stats.route_time:.1f} ms"
    print(f"[{args.method}] {result.stats.summary_line()}{routed}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.stats.to_dict()), file=sys.stderr)
    return 0


def _check_method(text: str) -> None:
    """Parse the method and check the files it names; a bench-only reference method gets
    an error that says so."""
    from adaspec.errors import InputError
    from adaspec.methods.registry import METHODS
    from adaspec.methods.spec import parse_method

    try:
        spec = parse_method(text)
    except InputError:
        from adaspec.lab.bench.references import REFERENCE_METHODS

        name = text.partition("@")[0].partition(":")[0].strip()
        if name in REFERENCE_METHODS:
            raise InputError(
                f"method {name!r} is a reference method that only `adaspec bench` runs; here "
                f"use one of: {', '.join(METHODS.names())}"
            ) from None
        raise
    spec.check_files()
