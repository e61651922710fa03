"""Two or more builds of ik_llama.cpp timed on the same calls, alternating, one process per
library and repeat (the library is loaded once per process): a kernel change is judged by
the ratio within a repeat, since this machine's speed drifts by 10% between minutes.

Each process loads the default target repacked (as adaspec runs it) and times, median of 11:
- `one`: a lone token after 300 cells (plain decoding);
- `block4` / `block8` / `block16`: 4 / 8 / 16 tokens of one sequence after 300 cells
  (verification);
- `round8`: one token for each of 8 sequences of 300 cells, regions on (`serve`'s rounds);
  `round8x2` / `round8x4`: 2 / 4 tokens each (a round verifying drafts);
- `prompt256`: a chunk of 256 prompt tokens;
and saves the logits of blocks of 1, 2, 3, 5, 8, 13 and 16 tokens, compared across libraries
bit for bit.

    .venv/bin/python experiments/ik_kernel_ab.py --lib base=/path/libllama.so \\
        --lib new=/other/libllama.so --repeats 3 --out results.json

The 512-bit k-quant walk is set as adaspec sets it on this CPU (`ADASPEC_IK_WIDE` decides
where given). `--env NAME:VAR=VALUE` sets an environment variable for one library's
processes, so one build can be timed against itself with a kernel switched off (`--lib amx=LIB --lib
pinned=LIB --env pinned:ADASPEC_IK_AMX=off`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = ("one", "block4", "block8", "block16", "round8", "round8x2", "round8x4",
          "prompt256")


def child(out: str, shapes: tuple[str, ...] = SHAPES) -> None:
    import numpy as np

    sys.path.insert(0, str(Path(__file__).parent))
    from ik_raw import Context, load_model

    from adaspec.backends.ik.backend import REGION_TOKENS
    from adaspec.store.catalog import TARGET_DEFAULT

    rng = random.Random(0)
    api, lib, model = load_model(TARGET_DEFAULT)
    if hasattr(lib, "adaspec_set_wide_rows"):  # the 512-bit walk as adaspec sets it here
        from adaspec.backends.ik.backend import WIDE_ENV, WIDE_ROWS
        from adaspec.store.native_build import cpu_vendor

        wide = os.environ.get(WIDE_ENV, "").strip().lower()
        on = wide == "on" or (wide in ("", "auto") and cpu_vendor() == "GenuineIntel")
        lib.adaspec_set_wide_rows.argtypes = [ctypes.c_int]
        lib.adaspec_set_wide_rows(WIDE_ROWS if on else 0)
    ctx = Context(lib, model, True, 9, n_ctx=9 * 2048)
    lib.adaspec_kv_regions.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    if lib.adaspec_kv_regions(ctx.ctx, REGION_TOKENS) != 0:
        sys.exit("this library lacks the kv-regions patch")
    for s in range(9):
        ctx.fill(s, 300, rng)
    logits = []
    for n in (1, 2, 3, 5, 8, 13, 16):
        ids = [rng.randrange(1000, 30000) for _ in range(n)]
        _, lg = ctx.decode([(0, 300 + i, t) for i, t in enumerate(ids)], want=set(range(n)))
        logits += [lg[i] for i in range(n)]
        ctx.roll_back()
    np.save(out + ".npy", np.stack(logits))

    def rows(shape: str) -> list[tuple[int, int, int]]:
        tok = lambda: rng.randrange(1000, 30000)  # noqa: E731
        if shape.startswith("round8"):
            each = int(shape.partition("x")[2] or 1)
            return [(s, 300 + i, tok()) for s in range(1, 9) for i in range(each)]
        n = {"one": 1, "block4": 4, "block8": 8, "block16": 16, "prompt256": 256}[shape]
        return [(0, 300 + i, tok()) for i in range(n)]

    medians = {}
    for shape in shapes:
        times = []
        for _ in range(6 if shape == "prompt256" else 12):
            seconds, _ = ctx.decode(rows(shape), every_row=shape != "prompt256")
            ctx.roll_back()
            times.append(seconds)
        medians[shape] = 1000 * statistics.median(times[1:])  # the first warms the shape
    Path(out).write_text(json.dumps(medians))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", action="append", required=True,
                    help="NAME=PATH of a libllama.so (libggml.so beside it); the first is the base")
    ap.add_argument("--env", action="append", default=[],
                    help="NAME:VAR=VALUE, an environment variable for library NAME's processes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="a JSON file for every repeat and the ratios")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"which calls to time (shorter processes drift less): {SHAPES}")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes = tuple(args.shapes.split(","))
    if not set(shapes) <= set(SHAPES):
        sys.exit(f"--shapes: choose from {', '.join(SHAPES)}")
    if args.child:
        return child(args.child, shapes)
    import numpy as np

    libs = dict(item.split("=", 1) for item in args.lib)
    if len(libs) < 2:
        sys.exit("give two --lib NAME=PATH or more")
    for name, path in libs.items():
        if not Path(path).is_file():
            sys.exit(f"--lib {name}: no file {path}")
    extra: dict[str, dict[str, str]] = {name: {} for name in libs}
    for item in args.env:
        name, _, setting = item.partition(":")
        var, eq, value = setting.partition("=")
        if name not in libs or not eq or not var:
            sys.exit(f"--env {item!r}: expected NAME:VAR=VALUE with NAME one of {list(libs)}")
        extra[name][var] = value
    tmp = tempfile.mkdtemp(prefix="ik-ab-")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in libs}
    for r in range(args.repeats):
        order = list(libs) if r % 2 == 0 else list(reversed(libs))
        for name in order:
            out = f"{tmp}/{name}-{r}.json"
            env = {**os.environ, "IK_LLAMA_CPP_LIB_PATH": libs[name], **extra[name]}
            subprocess.run([sys.executable, __file__, "--lib", "x=y", "--shapes", args.shapes,
                            "--child", out], env=env, check=True)
            runs[name].append(json.loads(Path(out).read_text()))
            print(name, r, {k: round(v, 1) for k, v in runs[name][-1].items()}, flush=True)
    base = next(iter(libs))
    ref = np.load(f"{tmp}/{base}-0.json.npy")
    report: dict = {"libraries": libs, "environment": extra, "repeats": runs,
                    "ratio_to_base": {}, "logits_equal": {}}
    for name in libs:
        if name == base:
            continue
        report["logits_equal"][name] = all(
            np.array_equal(ref, np.load(f"{tmp}/{name}-{r}.json.npy"))
            for r in range(args.repeats))
        report["ratio_to_base"][name] = {
            shape: [round(runs[name][r][shape] / runs[base][r][shape], 3)
                    for r in range(args.repeats)] for shape in shapes}
    print(json.dumps({k: report[k] for k in ("ratio_to_base", "logits_equal")}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
