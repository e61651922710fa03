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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from ik_kernel_driver import build_and_run, unpack  # noqa: E402

from adaspec.backends import ik_build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/adaspec-ik-amx-kernel",
                    help="where the source is unpacked and the driver built (a source patched "
                         "by an older adaspec stays as it is: give a fresh folder)")
    ap.add_argument("--out", default=None, help="a JSON file for the results")
    args = ap.parse_args()
    work = Path(args.work)
    kernels = unpack(work, ik_build.apply_patches)
    build_and_run(Path(__file__).with_suffix(".cpp"), kernels, work, {}, [], args.out)


if __name__ == "__main__":
    main()
