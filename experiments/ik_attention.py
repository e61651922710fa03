"""Attention over a cache of several sequences on ik_llama.cpp, with and without flash
attention (issue 33): what a batched call costs as the requests' contexts grow, and whether
a request's row stays bit for bit the same whatever else the call carries.

Eight sequences of one context (`n_seq_max` 8, one KV cache shared by the slots) are filled
to L cells each (random tokens); three of them then leave and come back with new prompts, so
their cells interleave with the others' as in a server. Then, in interleaved rounds, three
shapes are timed as one `llama_decode` each and rolled back: 8 requests x 1 token, 1 request
x 1 token, and a prompt chunk of 256 tokens beside 7 requests' tokens (medians). Exactness:
sequence 0's next-token row alone against the same row with 1, 3, 7 and 8 other requests
after it, as the last of 6 rows, and as the first row of a chain of 4 (maximum absolute
difference of the logits; 0 is bit for bit).

Without flash attention every row is scored against the cache's whole length and masked
after; with it (and adaspec's `fa-multi-sequence` patch, `backends/ik/patches/flash.py`),
blocks of cells the mask hides are skipped and rows of different sequences attend one at a
time. The library must be adaspec's native build with that patch (`adaspec runtime build`):
the pinned version's own flash attention aborts on this layout (`GGML_ASSERT(S > 0)`).

    .venv/bin/python experiments/ik_attention.py --out experiments/results/ik-attention-epyc
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from ik_raw import CHUNK, Context, load_model  # noqa: E402

from adaspec.backends import ik_flash_patch  # noqa: E402
from adaspec.backends.weights import llama_threads  # noqa: E402
from adaspec.lab.bench.machine import describe_machine  # noqa: E402
from adaspec.store.catalog import TARGET_DEFAULT  # noqa: E402

SLOTS = 8


def exactness(ctx: Context) -> dict[str, float]:
    """Sequence 0's row in other calls against it alone: max |difference|."""
    n = ctx.lengths
    _, ref = ctx.decode([(0, n[0], 77)], {0})
    ctx.roll_back()
    out = {}
    for others in (1, 3, 7):
        rows = [(0, n[0], 77)] + [(s, n[s], 88) for s in range(1, others + 1)]
        _, got = ctx.decode(rows, {0})
        ctx.roll_back()
        out[f"first of {others + 1} requests"] = float(np.abs(got[0] - ref[0]).max())
    rows = [(s, n[s], 88) for s in range(1, 6)] + [(0, n[0], 77)]
    _, got = ctx.decode(rows, {5})
    ctx.roll_back()
    out["last of 6 requests"] = float(np.abs(got[5] - ref[0]).max())
    rows = [(0, n[0] + i, 77 + i) for i in range(4)] + [(s, n[s], 88) for s in range(1, 8)]
    _, got = ctx.decode(rows, {0})
    ctx.roll_back()
    out["a chain of 4 beside 7 requests"] = float(np.abs(got[0] - ref[0]).max())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=TARGET_DEFAULT)
    ap.add_argument("--contexts", default="128,512,1024", help="cells per sequence")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default="experiments/results/ik-attention")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]

    api, lib, model = load_model(args.target)
    patched = ik_flash_patch.NAME in getattr(api, "adaspec_patches", ())
    if not patched:
        raise SystemExit("this ik_llama.cpp library lacks adaspec's fa-multi-sequence patch "
                         "(its flash attention aborts on several sequences): run `adaspec "
                         "runtime build` first")
    rows = []
    checks = {}
    for flash in (False, True):
        rng = random.Random(0)
        ctx = Context(lib, model, flash, SLOTS)
        for L in contexts:
            for s in range(SLOTS):
                ctx.fill(s, L, rng)
            for s in (6, 1, 3):  # requests that leave; new ones take their cells
                ctx.leave(s)
            for s in (3, 6, 1):
                ctx.fill(s, L, rng)
            shapes = {
                f"{SLOTS} requests x 1 token": [(s, L, 13) for s in range(SLOTS)],
                "1 request x 1 token": [(0, L, 13)],
                f"a {CHUNK}-token prompt chunk + {SLOTS - 1} requests x 1 token":
                    [(0, L + i, 13 + i) for i in range(CHUNK)]
                    + [(s, L, 13) for s in range(1, SLOTS)],
            }
            times: dict[str, list[float]] = {k: [] for k in shapes}
            for _ in range(args.rounds + 1):  # the first round warms up
                for name, shape in shapes.items():
                    times[name].append(ctx.decode(shape)[0])
                    ctx.roll_back()
            for name, t in times.items():
                rows.append({"flash_attention": flash, "cells_per_sequence": L, "shape": name,
                             "ms": round(1000 * statistics.median(t[1:]), 1)})
                print(f"flash {'on ' if flash else 'off'} L={L}: {name}: {rows[-1]['ms']} ms",
                      flush=True)
        checks["on" if flash else "off"] = exactness(ctx)
        ctx.close()
    lib.llama_free_model(model)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"target": args.target, "runtime": f"ik_llama.cpp ({api.adaspec_build}, patches "
              f"{list(api.adaspec_patches)})", "threads": llama_threads(),
              "machine": describe_machine(), "rounds": args.rounds, "rows": rows,
              "exactness": checks}
    (out / "ik_attention.json").write_text(json.dumps(record, indent=2))
    lines = [f"# Attention over {SLOTS} sequences in one cache ({args.target}, "
             f"{record['runtime']}, {llama_threads()} threads)", "",
             "ms of one call (medians), flash attention off / on:", "",
             "| cells per sequence | shape | off | on | on / off |",
             "| ---: | --- | ---: | ---: | ---: |"]
    for r in (r for r in rows if not r["flash_attention"]):
        on = next(x for x in rows if x["flash_attention"] and x["shape"] == r["shape"]
                  and x["cells_per_sequence"] == r["cells_per_sequence"])
        lines.append(f"| {r['cells_per_sequence']} | {r['shape']} | {r['ms']:.1f} | "
                     f"{on['ms']:.1f} | {on['ms'] / r['ms']:.2f} |")
    lines += ["", "Sequence 0's row against it alone in the same cache, max |logit difference| "
              "(0: bit for bit):", "", "| row | off | on |", "| --- | ---: | ---: |"]
    for name in checks["off"]:
        lines.append(f"| {name} | {checks['off'][name]:.3g} | {checks['on'][name]:.3g} |")
    (out / "ik_attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
