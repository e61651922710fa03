"""A region of the KV cache per sequence against the library's own placement (issue 33): the
same calls on two contexts of one process, alternating, so both see one machine state.

Both contexts get 8 sequences of `--prompt` tokens, then `--rounds` rounds of one token for
each (what requests decoded together do, which interleaves their cells without regions);
then each shape is timed `--repeats` times on both, the order swapped every repeat.

    .venv/bin/python experiments/ik_regions.py --out results.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from ik_raw import Context, load_model  # noqa: E402

from adaspec.backends.ik.backend import REGION_TOKENS, kv_regions  # noqa: E402
from adaspec.store.catalog import TARGET_DEFAULT  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=None, help="a JSON file for the medians")
    args = ap.parse_args()
    api, lib, model = load_model(TARGET_DEFAULT)
    if not kv_regions(api):
        sys.exit("this ik_llama.cpp library lacks the kv-regions patch (adaspec runtime build)")
    lib.adaspec_kv_regions.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.adaspec_kv_regions.restype = ctypes.c_int
    ctxs = {}
    for name, region in (("regions", REGION_TOKENS), ("off", 0)):
        rng = random.Random(0)
        ctx = Context(lib, model, True, 9, n_ctx=9 * 2048)  # as `serve --max-batch 8`
        if region and lib.adaspec_kv_regions(ctx.ctx, region) != 0:
            sys.exit("the library refused the regions")
        for s in range(1, 9):
            ctx.fill(s, args.prompt, rng)
        for _ in range(args.rounds):
            ctx.decode([(s, ctx.lengths[s], rng.randrange(1000, 30000)) for s in range(1, 9)],
                       set(range(8)))
            for s in range(1, 9):
                ctx.lengths[s] += 1
        ctxs[name] = ctx
    n = ctxs["off"].lengths
    shapes = {
        "8 x 1": [(s, n[s], 88) for s in range(1, 9)],
        "6 x 1": [(s, n[s], 88) for s in range(1, 7)],
        "8 x 2": [(s, n[s] + i, 88 + i) for s in range(1, 9) for i in range(2)],
        "7 x 1 + a 128-token chunk": [(s, n[s], 88) for s in range(1, 8)]
        + [(8, n[8] + i, 99 + i) for i in range(128)],
    }
    times: dict[tuple[str, str], list[float]] = {(c, k): [] for c in ctxs for k in shapes}
    for rep in range(args.repeats):
        for shape, rows in shapes.items():
            want = set(range(len(rows))) if "chunk" not in shape else set(range(7))
            for name in (("regions", "off") if rep % 2 == 0 else ("off", "regions")):
                seconds, _ = ctxs[name].decode(rows, want)
                ctxs[name].roll_back()
                times[(name, shape)].append(1000 * seconds)
    out = []
    for shape in shapes:
        on, off = times[("regions", shape)], times[("off", shape)]
        row = {"shape": shape, "regions_ms": round(statistics.median(on), 1),
               "off_ms": round(statistics.median(off), 1),
               "ratio": round(statistics.median(on) / statistics.median(off), 3),
               "regions_faster": sum(a < b for a, b in zip(on, off, strict=True)),
               "pairs": len(on)}
        out.append(row)
        print(json.dumps(row), flush=True)
    for ctx in ctxs.values():
        ctx.close()
    if args.out:
        Path(args.out).write_text(json.dumps({"prompt": args.prompt, "rounds": args.rounds,
                                              "rows": out}, indent=1))


if __name__ == "__main__":
    main()
