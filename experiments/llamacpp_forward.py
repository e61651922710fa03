"""llama.cpp as a verifier: forward time for n = 1, 2, 4, 8, 16 fed tokens, and whether a
block's logits equal feeding its tokens one at a time.

Runs the built-in GGUF files through `adaspec.backends.llamacpp.backend.LlamaCppBackend` (the
backend
the decode loop drives): a `--context`-token random context, then n tokens scored and the
cache rolled back, median of `--repeats`; then a real prompt's greedy continuation scored as
one block and token by token (max |logit difference|, argmax flips). Writes
llamacpp_forward.json and llamacpp_forward.md to --out. Needs the `llamacpp` extra.

    .venv/bin/python experiments/llamacpp_forward.py --out experiments/results/fastcpu-epyc
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fastcpu_forward import SIZES, time_forwards  # the same timing as the torch table
from fastcpu_row_invariance import compare, greedy_continuation  # the same check as torch's

from adaspec.backends.llamacpp.backend import load_gguf_backend
from adaspec.lab.bench.machine import describe_machine
from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=f"{TARGET_DEFAULT},{DRAFT_DEFAULT}")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--out", default="experiments/results/fastcpu")
    args = ap.parse_args()
    rows = []
    prompt = list(range(1000, 1000 + 40))  # fixed ids: the comparison needs no chat template
    for name in args.models.split(","):
        backend = load_gguf_backend(name, n_threads=args.threads, n_ctx=2048)
        ms = time_forwards(backend, args.context, args.repeats)
        same = compare(backend, prompt, greedy_continuation(backend, prompt, args.block))
        rows.append({"model": name, "ms": {str(n): round(v, 1)
                     for n, v in ms.items()}, f"block{args.block}": same})
        print(f"{name}: " + " ".join(f"n={n}:{v:.0f}ms" for n, v in ms.items()) +
              f" block vs single: {same}", flush=True)
        del backend
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": describe_machine(), "threads": args.threads, "context": args.context,
            "repeats": args.repeats}
    (out / "llamacpp_forward.json").write_text(json.dumps({**meta, "rows": rows}, indent=2)
                                               + "\n")
    lines = [
        f"# llama.cpp forward time per call (median of {args.repeats}, context {args.context}, "
        f"{args.threads} threads)", "", f"Machine: {meta['machine']}", "",
        "| model | " + " | ".join(f"n={n}" for n in SIZES) +
        f" | block of {args.block} vs one at a time: max abs diff | argmax flips |",
        "| --- | " + " | ".join("---:" for _ in SIZES) + " | ---: | ---: |",
    ]
    for r in rows:
        same = r[f"block{args.block}"]
        lines.append(f"| {r['model']} | " + " | ".join(f"{r['ms'][str(n)]:.0f} ms" for n in SIZES)
                     + f" | {same['max_abs_diff']:.4g} | {same['argmax_flips']} |")
    (out / "llamacpp_forward.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
