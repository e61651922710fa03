"""The repacked Q4_K and Q6_K kernels against their AMX versions (`k-quant-amx-2`), in one
process: a kernel-level A/B that the machine's drift between processes cannot blur.

It unpacks the pinned ik_llama.cpp source (as `adaspec runtime build` does, from pip's cache
when it is there), applies adaspec's patches (`ik_build.apply_patches`), and compiles
`ik_amx_kernel.cpp` with the patched kernels file included: the kernels the native library
has, called alternately on random weights of the 1.5B target's Q4_K and Q6_K shapes (the
pinned kernel in calls of 8 rows, as ik's driver splits them; the tile kernel on all rows at
once, as the patched driver calls it), every output compared bit for bit. Needs a CPU with
AMX and the native build's `libggml.so` (`make setup` on such a CPU).

    .venv/bin/python experiments/ik_amx_kernel.py --out experiments/results/ik-amx-xeon/kernel.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from adaspec.backends import ik_build, ikllama
from adaspec.store import native_build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/adaspec-ik-amx-kernel",
                    help="where the source is unpacked and the driver built (a source patched "
                         "by an older adaspec stays as it is: give a fresh folder)")
    ap.add_argument("--out", default=None, help="a JSON file for the results")
    args = ap.parse_args()
    lib = ik_build.native_library(ikllama.IK_VERSION)
    if lib is None:
        sys.exit("no native ik_llama.cpp build for this CPU: run `adaspec runtime build`")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src, _ = native_build.fetch_source(ik_build.PACKAGE, ikllama.IK_VERSION, "ik_llama.cpp",
                                       work, ik_build.WHAT, print)
    ik_build.apply_patches(src)
    driver = work / "ik_amx_kernel"
    kernels = src / "ggml/src/iqk/iqk_gemm_kquants.cpp"
    compile_cmd = ["g++", "-O3", "-march=native", "-std=c++17",
                   f'-DIK_KERNELS_FILE="{kernels}"',
                   *(f"-I{src / d}" for d in ("ggml/include", "ggml/src", "ggml/src/iqk")),
                   str(Path(__file__).with_suffix(".cpp")), "-o", str(driver),
                   f"-L{lib.parent}", "-lggml", f"-Wl,-rpath,{lib.parent}"]
    built = subprocess.run(compile_cmd, capture_output=True, text=True)
    if built.returncode != 0:
        sys.exit(f"compiling the driver failed:\n{built.stderr[-3000:]}")
    ran = subprocess.run([str(driver)], capture_output=True, text=True)
    rows = [json.loads(line) for line in ran.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        print(row, flush=True)
    if ran.returncode != 0:
        sys.exit(f"the driver stopped ({ran.returncode}): {ran.stderr[-2000:]}")
    report = {"machine": native_build.cpu_signature(), "compile": compile_cmd, "shapes": rows,
              "bit_for_bit": all(r["differ"] == 0 for r in rows)}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
