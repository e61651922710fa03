"""`adaspec serve`: the OpenAI-compatible server (docs/serve.md)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from adaspec.cli.model_options import add_model_options
from adaspec.methods.spec import DEFAULT_METHOD

API_KEY_ENV = "ADASPEC_API_KEY"  # the same name as adaspec.serve.config's (kept light here)


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server: chat and text completions, streaming, "
             "metrics, a playground",
        description="Serve the target model's answers, decoded speculatively, over an "
                    "OpenAI-compatible HTTP API (see docs/serve.md).",
    )
    p.add_argument("--method", default=DEFAULT_METHOD,
                   help=f"default decoding method (default {DEFAULT_METHOD}; a request's "
                        "`method` field overrides it; see `adaspec methods`)")
    add_model_options(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    p.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait behind the one decoding (default 16); "
                        "more get 429 with Retry-After")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a request may take from arrival to its last token (default 600)")
    p.add_argument("--api-key", default=None,
                   help=f"require this key (Authorization: Bearer KEY); default: ${API_KEY_ENV}"
                        " if set, else no key")
    p.add_argument("--model-name", default=None,
                   help="the model id clients name (default: the target's name)")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="new tokens when a request gives no max_tokens (default 512)")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help="on SIGTERM, seconds to let requests in flight finish (default: --timeout)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--ray", action="store_true",
                   help="run as a Ray Serve deployment (needs `ray[serve]`)")
    p.add_argument("--replicas", type=int, default=1,
                   help="with --ray: model instances, one per replica (default 1)")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from adaspec.errors import InputError
    from adaspec.methods.spec import parse_method

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise InputError(f"adaspec serve needs {', '.join(missing)}: pip install -e '.[serve]'")
    parse_method(args.method)  # a typo fails before any model loads
    for name, value, low in (("--max-queue", args.max_queue, 0), ("--max-tokens",
                             args.max_tokens, 1), ("--replicas", args.replicas, 1)):
        if value < low:
            raise InputError(f"{name} must be >= {low}, got {value}")
    if args.timeout <= 0:
        raise InputError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.ray and importlib.util.find_spec("ray") is None:
        raise InputError("--ray needs Ray Serve: pip install -e '.[ray]'")

    from adaspec.serve.config import ServeConfig

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"adaspec serve: warning: listening on {args.host} without an API key "
              f"(--api-key or ${API_KEY_ENV})", file=sys.stderr)
    config = ServeConfig(
        method=args.method, target=args.target, draft=args.draft, dtype=args.dtype,
        quant=args.quant, draft_quant=args.draft_quant, host=args.host, port=args.port,
        max_queue=args.max_queue, timeout=args.timeout, api_key=api_key,
        model_name=args.model_name, default_max_tokens=args.max_tokens,
        drain_timeout=args.drain_timeout,
    )
    if args.ray:
        from adaspec.serve.ray_app import run_ray

        return run_ray(config, args.replicas)
    from adaspec.serve.server import run

    return run(config, log_level=args.log_level)
