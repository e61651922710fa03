"""What a call of n rows of one sequence costs in ik_llama.cpp, per row, with the weights
repacked (adaspec's default) and in the GGUF's own layout: where the matmul kernels change
(ik converts k-quant weights for 32 rows and more, the repacked ones never), and so what a
batched round of 8 requests' rows costs against a prompt chunk's rows.

    python experiments/ik_rows.py --out experiments/results/ik-rows-epyc/rows.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from ik_raw import Context, load_model

from adaspec.store.catalog import TARGET_DEFAULT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=TARGET_DEFAULT)
    ap.add_argument("--rows", default="1,4,8,16,24,32,64,128")
    ap.add_argument("--context", type=int, default=256, help="cached tokens before each call")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [int(n) for n in args.rows.split(",")]
    rng = random.Random(0)
    record: dict = {"target": args.target, "context": args.context, "ms_per_row": {}}
    for repack in (True, False):
        api, lib, model = load_model(args.target, repack)
        ctx = Context(lib, model, flash=True, sequences=1, n_ctx=4096)
        ctx.fill(0, args.context, rng)
        out = {}
        for n in rows:
            times = []
            for _ in range(args.repeats + 1):
                ids = [rng.randrange(1000, 30000) for _ in range(n)]
                seconds, _ = ctx.decode([(0, args.context + i, t) for i, t in enumerate(ids)],
                                        every_row=True)
                ctx.roll_back()
                times.append(seconds)
            out[n] = round(1000 * statistics.median(times[1:]) / n, 2)
            print(f"repack={repack} n={n}: {out[n]} ms/row", flush=True)
        record["ms_per_row"]["repacked" if repack else "gguf"] = out
        ctx.close()
        lib.llama_free_model(model)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
