"""Core benchmark: plain decoding vs adaspec drafters vs Hugging Face assisted generation on
the first HumanEval problems, greedy, bf16, the built-in pair.

A thin preset over `adaspec bench` (one runner, one summary): the same loaded models, methods
alternating prompt by prompt after a warm-up, speedups as ratios over plain decoding within
the run. Writes results.jsonl (rows as they finish), summary.json, summary.md and plots.

    .venv/bin/python experiments/core_humaneval.py --limit 20 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import sys

from adaspec.cli import main as adaspec_main

DEFAULT_METHODS = (
    "ar,ngram:k=8,draft:k=3,draft:k=5,draft:ctrl=heuristic,hf-assisted,hf-assisted-constant:k=5"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="experiments/results/core_humaneval")
    ap.add_argument("--resume", action="store_true", help="continue an interrupted run")
    args = ap.parse_args(argv)
    return adaspec_main(
        [
            "bench",
            "--suite",
            "humaneval",
            "--limit",
            str(args.limit),
            "--methods",
            args.methods,
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--dtype",
            args.dtype,
            "--out",
            args.out,
            "--resume" if args.resume else "--overwrite",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
