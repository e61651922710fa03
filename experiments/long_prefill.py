"""Prefill cost as a conversation grows: chunks of new tokens scored after longer and longer
cached histories on ik_llama.cpp, the server's layout (a region per sequence, flash
attention's one path for every row) against the pinned kernels (no flash attention).

Why: a conversation's turn prefills only its new tokens (the rest is held in the cache), yet
its first token still grows with the history, through attention over the held cells. This
separates that growth from the weights' share, per layout.

    python experiments/long_prefill.py \
        --out experiments/results/serve-path-long-epyc-avx2/prefill.md
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import subprocess
import sys
import time

LAYOUTS = {
    # what `adaspec serve` runs: 4 requests besides the context's own sequence
    "server (regions, flash one path, 5 sequences)": ({}, 5),
    "generate (regions, flash one path, 1 sequence)": ({}, 1),
    "pinned kernels (no flash attention, 1 sequence)": ({"ADASPEC_IK_FLASH_ATTN": "off"}, 1),
}


def measure(sequences: int, chunk: int, upto: int) -> list[tuple[int, float, float]]:
    """(history, seconds for `chunk` new tokens, ms of one decode step after them)."""
    from adaspec.backends.gguf import gguf_file
    from adaspec.backends.ik.backend import IkLlamaBackend, context_for
    from adaspec.backends.sequences import ALL, LAST, Feed
    from adaspec.backends.weights import llama_threads
    from adaspec.store.catalog import TARGET_DEFAULT

    backend = IkLlamaBackend(gguf_file(TARGET_DEFAULT), n_threads=llama_threads(),
                             n_ctx=context_for(sequences), sequences=sequences, min_rows=None)
    rng = random.Random(0)
    ids = [rng.randrange(1000, 30000) for _ in range(upto + chunk + 1)]
    seq = 1 if sequences > 1 else 0
    rows = []
    for start in range(0, upto + 1, chunk):
        t0 = time.perf_counter()
        backend.feed_many([Feed(seq, start, ids[start:start + chunk], LAST)])
        seconds = time.perf_counter() - t0
        end = start + chunk
        steps = []
        for _ in range(3):
            t0 = time.perf_counter()
            backend.feed_many([Feed(seq, end, ids[end:end + 1], ALL)])
            steps.append(1000 * (time.perf_counter() - t0))
            backend.remove_seq(seq, end)
        rows.append((start, seconds, min(steps)))
        print(f"  history {start}: {chunk} tokens in {seconds:.2f} s, a decode step "
              f"{min(steps):.1f} ms", file=sys.stderr, flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--chunk", type=int, default=600, help="new tokens per turn")
    p.add_argument("--upto", type=int, default=3600, help="the longest history before a chunk")
    p.add_argument("--layout", help="one layout's name (internal: each runs in a child)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.layout:  # the child: one layout, its rows on stdout
        rows = measure(LAYOUTS[args.layout][1], args.chunk, args.upto)
        print(repr(rows))
        return 0
    from report import write_report

    lines = [f"{args.chunk} new tokens scored after a history of H cached tokens (one "
             "sequence's), then one decode step; ik_llama.cpp, the built-in target.", ""]
    results = {}
    for name, (env, _) in LAYOUTS.items():
        print(name, file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, __file__, "--layout", name, "--chunk",
                              str(args.chunk), "--upto", str(args.upto)],
                             env={**os.environ, **env}, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            return 1
        results[name] = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    names = list(results)
    lines += ["| history | " + " | ".join(f"{n}: s for the chunk (x at 0), decode ms"
                                          for n in names) + " |",
              "| ---: |" + " ---: |" * len(names)]
    for i, (start, *_) in enumerate(results[names[0]]):
        cells = []
        for n in names:
            _, s, ms = results[n][i]
            cells.append(f"{s:.2f} ({s / results[n][0][1]:.2f}x), {ms:.1f}")
        lines.append(f"| {start} | " + " | ".join(cells) + " |")
    write_report("Prefill as a conversation grows", lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
