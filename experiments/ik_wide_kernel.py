"""The repacked Q4_K and Q6_K kernels against their 512-bit walks (`k-quant-wide`), in one
process: a kernel-level A/B that the machine's drift between processes cannot blur.

It unpacks the pinned ik_llama.cpp source (as `adaspec runtime build` does, from pip's cache
when it is there), applies the patches that come before the wide walk (the one-row guard,
the prefetch and the two-group walk), and compiles `ik_wide_kernel.cpp` with that kernels
file and `backends/ik/patches/ik_wide.cpp` included: the kernel as the library had it, and the
wide walk
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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from ik_kernel_driver import build_and_run, unpack  # noqa: E402

from adaspec.backends import ik_two_groups_patch  # noqa: E402
from adaspec.backends.ik import build as ik_build
from adaspec.backends.ik.patches import prefetch as ik_prefetch_patch

WIDE = Path(ik_build.__file__).with_name("ik_wide.cpp")


def before_wide(src: Path) -> None:
    """The patches that come before the wide walk, not it."""
    ik_build.patch_source(src)
    ik_prefetch_patch.apply(src)
    ik_two_groups_patch.apply(src)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/adaspec-ik-wide-kernel",
                    help="where the source is unpacked and the driver built")
    ap.add_argument("--threads", type=int, default=2, help="threads splitting the weight rows")
    ap.add_argument("--repeats", type=int, default=9, help="timed calls a kernel, alternating")
    ap.add_argument("--out", default=None, help="a JSON file for the results")
    args = ap.parse_args()
    work = Path(args.work)
    kernels = unpack(work, before_wide)
    if "adaspec_q4_k_r4_wide" in kernels.read_text():
        sys.exit(f"{kernels} already has the wide walk: give a fresh --work folder")
    build_and_run(Path(__file__).with_suffix(".cpp"), kernels, work, {"ADASPEC_WIDE_FILE": WIDE},
                  [str(args.threads), str(args.repeats)], args.out, threads=args.threads)


if __name__ == "__main__":
    main()
