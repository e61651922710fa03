"""The `adaspec` command line: generate, bench, models, runtime, methods."""

from __future__ import annotations

import argparse
import sys

from adaspec.errors import AdaspecError


def build_parser() -> argparse.ArgumentParser:
    from adaspec.cli.bench import add_bench_parser
    from adaspec.cli.disco import add_disco_parser
    from adaspec.cli.generate import add_generate_parser
    from adaspec.cli.head import add_head_parser
    from adaspec.cli.models import add_models_parser
    from adaspec.cli.osd import add_osd_parser
    from adaspec.cli.profile import add_profile_parser
    from adaspec.cli.router import add_router_parser
    from adaspec.cli.runtime import add_runtime_parser
    from adaspec.cli.s2d import add_s2d_parser
    from adaspec.cli.serve import add_serve_parser

    parser = argparse.ArgumentParser(
        prog="adaspec",
        description="Adaptive speculative decoding: the target model's output, faster.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_models_parser(sub)
    add_profile_parser(sub)
    add_runtime_parser(sub)
    add_disco_parser(sub)
    add_router_parser(sub)
    add_s2d_parser(sub)
    add_head_parser(sub)
    add_osd_parser(sub)
    add_serve_parser(sub)
    methods = sub.add_parser("methods", help="list decoding methods and their parameters")
    methods.add_argument("--markdown", action="store_true",
                         help="the README's tables of methods, controllers and verifiers")
    methods.set_defaults(func=_cmd_methods)
    return parser


def _cmd_methods(args: argparse.Namespace) -> int:
    from adaspec.lab.bench.references import REFERENCE_METHODS
    from adaspec.methods.spec import describe_methods, methods_markdown

    print(methods_markdown() if args.markdown else describe_methods(extra=REFERENCE_METHODS))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except AdaspecError as exc:
        print(f"adaspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("adaspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
