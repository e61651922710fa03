"""`adaspec serve`: the OpenAI-compatible server (docs/serve.md)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from adaspec.cli.model_options import add_model_options
from adaspec.methods.spec import DEFAULT_METHOD
from adaspec.serve.config import API_KEY_ENV, AUTO_SLOTS


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
    add_model_options(p, device=True)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    p.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait behind the ones decoding (default 16); "
                        "more get 429 with Retry-After")
    p.add_argument("--max-batch", default="auto", metavar="N|auto",
                   help="requests decoded together, one target call a step for all of them "
                        "(continuous batching; 1: one at a time, the others queued; default "
                        f"auto: {AUTO_SLOTS} where the target's runtime batches, ik_llama.cpp "
                        "or the static torch runtime, else 1)")
    p.add_argument("--cache-slots", default="auto", metavar="N|auto",
                   help="sequences of the KV cache, at least --max-batch: an idle one keeps "
                        "its last request's prompt and answer, so a conversation's next turn "
                        "prefills only what it adds; room is made least recently used first "
                        "(default auto: 4 x --max-batch on ik_llama.cpp, whose sequences share "
                        "one pool of cells; --max-batch on the static runtime)")
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
    p.add_argument("--gpus-per-replica", type=float, default=None,
                   help="with --ray: GPUs Ray reserves for each replica (default 1 when the "
                        "models run on a CUDA GPU, else 0)")
    g = p.add_argument_group("cross-request history (docs/auto.md)")
    g.add_argument("--history", default="", metavar="PATH|off",
                   help="where the history that methods draft from (auto, by default) is kept: "
                        "loaded at start, saved every --history-every requests and at exit "
                        "(default $ADASPEC_HOME/history/<target>.history; off: in memory only)")
    g.add_argument("--history-every", type=int, default=16,
                   help="finished requests between two saves of the history (default 16)")
    g.add_argument("--history-tokens", type=int, default=1_000_000,
                   help="tokens the history holds; the oldest requests go first "
                        "(default 1000000, about 260 MB)")
    add_online_options(p)
    p.set_defaults(func=run_serve)


def add_online_options(p: argparse.ArgumentParser, switch: bool = True) -> None:
    """Online distillation (OSD, docs/osd.md): shared by `serve` and `osd simulate`."""
    g = p.add_argument_group("online distillation (docs/osd.md)")
    if switch:
        g.add_argument("--online-distill", action="store_true",
                       help="keep distilling the draft on served traffic: the draft head "
                            "where the default method drafts with it (--method head, or "
                            "auto:use=...+head; any runtime that gives the target's "
                            "features), else the draft model (torch draft weights and a "
                            "draft-model chain method, e.g. --method draft:k=3 "
                            "--draft-weights int8)")
    g.add_argument("--interval", type=int, default=16,
                   help="requests of a domain between two updates (default 16)")
    g.add_argument("--osd-positions", type=int, default=0,
                   help="also update once a domain has buffered this many new positions "
                        "(default 0: only every --interval requests)")
    g.add_argument("--loss", default="jsd:0.5",
                   help="fkl | rkl | jsd[:beta] (default jsd:0.5)")
    g.add_argument("--sampling", default="teacher", choices=["teacher", "student", "mixed"],
                   help="train on the served tokens (teacher), on the draft's own "
                        "continuations scored by the target (student), or both (mixed)")
    g.add_argument("--osd-layers", type=int, default=2,
                   help="the draft's last layers that learn (default 2)")
    g.add_argument("--osd-steps", type=int, default=8, help="optimizer steps per update")
    g.add_argument("--osd-lr", type=float, default=1e-5,
                   help="the draft model's learning rate (default 1e-5)")
    g.add_argument("--osd-head-lr", type=float, default=3e-4,
                   help="the draft head's learning rate, where the head learns (default 3e-4)")
    g.add_argument("--osd-head-grow", type=int, default=2048,
                   help="tokens the head's kept set may gain from what the target writes, "
                        "each once written 3 times (default 2048; 0: the shipped set)")
    g.add_argument("--osd-head-backoff", type=int, default=4,
                   help="while the probe keeps refusing a learned head no better than the "
                        "shipped one (traffic it already knows), learn from one request in 2, "
                        "4, ... up to one in this many (default 4; 1: every request)")
    g.add_argument("--osd-top-k", type=int, default=32,
                   help="target probabilities kept per recorded position (default 32)")
    g.add_argument("--osd-record", default="rejected", choices=["rejected", "all"],
                   help="record where the draft missed (default) or every drafted position")
    g.add_argument("--osd-buffer", type=int, default=4096,
                   help="recorded positions kept per domain (default 4096)")
    g.add_argument("--osd-domains", default="shared", choices=["shared", "field", "classifier"],
                   help="one draft for all (shared), one per request `domain` field, or per "
                        "domain with a classifier labelling requests that name none")
    g.add_argument("--osd-nice", type=int, default=19,
                   help="the update worker's nice value (default 19: it uses CPU time serving "
                        "leaves idle; 0: the same priority as serving)")
    g.add_argument("--osd-dir", default="",
                   help="where adapters are saved (default $ADASPEC_HOME/osd/<draft>-last<L>)")


def _max_batch(text: str, flag: str = "--max-batch") -> int | None:
    """--max-batch (or `flag`): a number of slots, or None for auto."""
    from adaspec.errors import InputError

    value = str(text).strip().lower()
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise InputError(f"{flag} must be a whole number >= 1 or 'auto', got {text!r}")
    return int(value)


def run_serve(args: argparse.Namespace) -> int:
    from adaspec.errors import InputError
    from adaspec.methods.spec import parse_method

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise InputError(f"adaspec serve needs {', '.join(missing)}: pip install -e '.[serve]'")
    parse_method(args.method).check_files()  # a typo fails before any model loads
    max_batch = _max_batch(args.max_batch)
    cache_slots = _max_batch(args.cache_slots, "--cache-slots")
    for name, value, low in (("--max-queue", args.max_queue, 0),
                             ("--max-tokens", args.max_tokens, 1), ("--replicas", args.replicas, 1),
                             ("--history-every", args.history_every, 1),
                             ("--history-tokens", args.history_tokens, 1)):
        if value < low:
            raise InputError(f"{name} must be >= {low}, got {value}")
    if args.timeout <= 0:
        raise InputError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.ray and importlib.util.find_spec("ray") is None:
        raise InputError("--ray needs Ray Serve: pip install -e '.[ray]'")

    from adaspec.backends.device import resolve_device
    from adaspec.serve.config import ServeConfig, auto_cache_slots, auto_max_batch

    device = resolve_device(args.device)  # a missing GPU is named before any model loads
    gpus = args.gpus_per_replica
    if gpus is None:
        gpus = 1.0 if device == "cuda" else 0.0
    if gpus < 0 or (gpus > 0 and device != "cuda"):
        raise InputError(f"--gpus-per-replica {gpus:g}: give a number >= 0, and GPUs only "
                         "with --device cuda")
    if args.gpus_per_replica is not None and not args.ray:
        raise InputError("--gpus-per-replica is a Ray Serve setting: add --ray")
    online = None
    if args.online_distill:
        if args.ray:
            raise InputError("--online-distill runs in one server process; drop --ray")
        from adaspec.online.options import online_config

        online = online_config(args)

    if max_batch is None:
        max_batch = auto_max_batch(args.method, args.target, args.weights, device)
    if cache_slots is None:
        cache_slots = auto_cache_slots(args.method, args.target, args.weights, device,
                                       max_batch)
    if max_batch > 1 and cache_slots < max_batch:
        raise InputError(f"--cache-slots {cache_slots} is fewer than --max-batch {max_batch}: "
                         "every request decoded needs a sequence of its own")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"adaspec serve: warning: listening on {args.host} without an API key "
              f"(--api-key or ${API_KEY_ENV})", file=sys.stderr)
    config = ServeConfig(
        method=args.method, target=args.target, draft=args.draft, dtype=args.dtype,
        weights=args.weights, draft_weights=args.draft_weights, device=args.device,
        host=args.host, port=args.port,
        max_queue=args.max_queue, max_batch=max_batch, cache_slots=cache_slots,
        timeout=args.timeout,
        api_key=api_key,
        model_name=args.model_name, default_max_tokens=args.max_tokens,
        drain_timeout=args.drain_timeout, online=online, history=args.history,
        history_every=args.history_every, history_tokens=args.history_tokens,
    )
    if args.ray:
        from adaspec.serve.ray_app import run_ray

        return run_ray(config, args.replicas, gpus_per_replica=gpus)
    from adaspec.serve.server import run

    return run(config, log_level=args.log_level)
