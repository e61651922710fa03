"""The repacked Q4_K and Q6_K kernels against their 512-bit walks (`k-quant-wide`), in one
process: a kernel-level A/B that the machine's drift between processes cannot blur.

It unpacks the pinned ik_llama.cpp source (as `adaspec runtime build` does, from pip's cache
when it is there), applies the patches that come before the wide walk (the one-row guard,
the prefetch and the two-group walk), and compiles `ik_wide_kernel.cpp` with that kernels
file and `backends/ik_wide.cpp` included: the kernel as the library had it, and the wide walk
followed by that kernel for the rows it leaves, called alternately on random weights of the
1.5B target's shapes (streamed from memory: 64 copies a shape, or the output head's 117 MB
once), every output compared bit for bit, also for every row count 1-8 and 16 on a shape
with a last group of 4 weight rows. Needs a CPU with AVX-512 and the native build's
`libggml.so` (`make setup`).

    .venv/bin/python experiments/ik_wide_kernel.py --threads 2 \\
        --out experiments/results/ik-wide-xeon/kernel.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from adaspec.backends import ik_build, ik_prefetch_patch, ik_two_groups_patch, ikllama
from adaspec.store import native_build

WIDE = Path(ik_build.__file__).with_name("ik_wide.cpp")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/adaspec-ik-wide-kernel",
                    help="where the source is unpacked and the driver built")
    ap.add_argument("--threads", type=int, default=2, help="threads splitting the weight rows")
    ap.add_argument("--repeats", type=int, default=9, help="timed calls a kernel, alternating")
    ap.add_argument("--out", default=None, help="a JSON file for the results")
    args = ap.parse_args()
    lib = ik_build.native_library(ikllama.IK_VERSION)
    if lib is None:
        sys.exit("no native ik_llama.cpp build for this CPU: run `adaspec runtime build`")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src, _ = native_build.fetch_source(ik_build.PACKAGE, ikllama.IK_VERSION, "ik_llama.cpp",
                                       work, ik_build.WHAT, print)
    ik_build.patch_source(src)  # the patches before the wide walk, not it
    ik_prefetch_patch.apply(src)
    ik_two_groups_patch.apply(src)
    kernels = src / "ggml/src/iqk/iqk_gemm_kquants.cpp"
    if "adaspec_q4_k_r4_wide" in kernels.read_text():
        sys.exit(f"{kernels} already has the wide walk: give a fresh --work folder")
    driver = work / "ik_wide_kernel"
    compile_cmd = ["g++", "-O3", "-march=native", "-std=c++17", "-pthread",
                   f'-DIK_KERNELS_FILE="{kernels}"', f'-DADASPEC_WIDE_FILE="{WIDE}"',
                   *(f"-I{src / d}" for d in ("ggml/include", "ggml/src", "ggml/src/iqk")),
                   str(Path(__file__).with_suffix(".cpp")), "-o", str(driver),
                   f"-L{lib.parent}", "-lggml", f"-Wl,-rpath,{lib.parent}"]
    built = subprocess.run(compile_cmd, capture_output=True, text=True)
    if built.returncode != 0:
        sys.exit(f"compiling the driver failed:\n{built.stderr[-3000:]}")
    ran = subprocess.run([str(driver), str(args.threads), str(args.repeats)],
                         capture_output=True, text=True)
    rows = [json.loads(line) for line in ran.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        print(row, flush=True)
    if ran.returncode != 0:
        sys.exit(f"the driver stopped ({ran.returncode}): {ran.stderr[-2000:]}")
    report = {"machine": native_build.cpu_signature(), "compile": compile_cmd,
              "threads": args.threads, "shapes": rows,
              "bit_for_bit": all(r["differ"] == 0 for r in rows)}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
