"""The repacked Q4_K and Q6_K kernels walk 8 weight rows at a time in 512-bit registers.

Why: a round of requests decoded together (one token each for up to 8 of them) spent 77% of
its time in these two kernels (`mul_mat_q4_k_r4_q8_k<8>` 55%, `mul_mat_q6_k_r4_q8_k<8>` 22%;
`perf` on a 2-vCPU Intel Xeon), and those run on 256-bit registers, 4 weight rows at a time,
shuffling each activation into place for one dot product. On a CPU with AVX-512 the walk
here holds two groups of 4 rows in the halves of one 512-bit register: each shuffle feeds
both and each instruction does both groups' work. It fetches ahead in its own order (the
kernels' prefetch, two blocks ahead within a group of 4, misses the second group's first
blocks), for a lone row too: the kernels' prefetch leaves a lone row to the hardware
prefetcher, and on a 2-vCPU Xeon the wide walk of a lone row then streamed slower than its
walk of two rows (Q4_K 1536 -> 8960: 553 us against 454). Every lane does the pinned
kernel's integer and float operations for its rows, in the same order, so the logits stay
bit for bit equal, whatever the call's shape. Measured in one process on the 1.5B target's
shapes, weights streamed from memory, two threads: 8 activation rows 0.76-0.90 of the
pinned kernel's time, 1 row 0.53-0.63 with its prefetch (0.82-0.99 without;
`experiments/ik_wide_kernel.py`, `experiments/results/ik-wide-xeon/`).

Calls of up to 8 rows take it (ik's driver splits rows into calls of 8); longer calls keep
the two-group walk (`ik/patches/two_groups.py`) or the AMX tiles. Without AVX-512 nothing
changes. Needs the two-group patch, whose loop start it takes over.

Since `-3` the walk is a switch of the loaded library (`adaspec_set_wide_rows`: the most
activation rows a call walks wide, 0 for none), set per CPU by `backends/ik/backend.py`:
on the 2-vCPU AMD EPYC with AVX-512 (family 25, whose cores split a 512-bit instruction in
two halves) the wide walk was the slower one, a lone row's plain step 45-49 ms against
22-39 ms with the kernel's own walk, 2 rows 56 against 38-45, 4 rows 62 against 52-56, 8
rows alike, the logits bit for bit the same either way (`experiments/results/
ik-wide-zen-epyc/`). So it runs where it was measured to pay (Intel's AVX-512), and
ADASPEC_IK_WIDE=on/off overrides.
"""

from __future__ import annotations

from pathlib import Path

from adaspec.backends.ik.patches import two_groups as ik_two_groups_patch
from adaspec.backends.ik.source import PatchError, patch_file

NAME = "k-quant-wide-3"  # 2: a lone row fetches ahead too; 3: a switch per CPU
FILE = ik_two_groups_patch.FILE
MARK = "adaspec_q4_k_r4_wide"

KERNEL = ik_two_groups_patch.KERNEL  # the pinned x86 Q4_K kernel: the helpers go before it
Q4_LOOP = ik_two_groups_patch.LOOP_FROM
Q4_LOOP_FROM = Q4_LOOP.replace(ik_two_groups_patch.MARK, MARK)
Q6_LOOP = ("    for (int ix = 0; ix < nrc_x; ix += 4) {\n"
           "        const block_q6_k_r4 * iq6 = "
           "(const block_q6_k_r4 *)((const char *)vx + (ix+0)*bx);\n")
Q6_LOOP_FROM = Q6_LOOP.replace("int ix = 0;",
                                "int ix = adaspec_q6_k_r4_wide<nrc_y>(n, vx, bx, info, nrc_x);")
HELPER = (Path(__file__).parent / "ik_wide.cpp").read_text
# the switch, at file scope before the kernels' anonymous namespace (C linkage, exported)
SWITCH_ANCHOR = "#ifdef IQK_IMPLEMENT\n"
SETTER = "adaspec_set_wide_rows"
SWITCH = f"""// adaspec ({NAME}, its switch): the most activation rows a call walks 8 weight
// rows wide (0: none); set per CPU where the library is loaded (`backends/ik/backend.py`)
extern "C" {{
int adaspec_wide_rows = 8;
__attribute__((visibility("default"))) void {SETTER}(int rows) {{ adaspec_wide_rows = rows; }}
}}

"""


def patch_text(text: str) -> str:
    """The kernels file with the wide walks (unchanged when already there)."""
    if MARK in text:
        return text
    if ik_two_groups_patch.MARK not in text:
        raise PatchError(f"{FILE}: the two-group patch goes first ({ik_two_groups_patch.NAME})")
    for anchor in (SWITCH_ANCHOR, KERNEL, Q4_LOOP, Q6_LOOP):
        if text.count(anchor) != 1:
            raise PatchError(f"{FILE}: expected one `{anchor.strip().splitlines()[0]}`, "
                             f"found {text.count(anchor)}")
    kernel = text.index(KERNEL)
    if not kernel < text.index(Q4_LOOP) < text.index(Q6_LOOP):
        raise PatchError(f"{FILE}: the Q4_K and Q6_K loops are not after "
                         f"`{KERNEL.splitlines()[1]}`")
    if not text.index(SWITCH_ANCHOR) < kernel:
        raise PatchError(f"{FILE}: `{SWITCH_ANCHOR.strip()}` is not before the kernels")
    text = text.replace(KERNEL, HELPER() + "\n" + KERNEL)
    text = text.replace(SWITCH_ANCHOR, SWITCH + SWITCH_ANCHOR)
    return text.replace(Q4_LOOP, Q4_LOOP_FROM).replace(Q6_LOOP, Q6_LOOP_FROM)


def apply(src: Path) -> None:
    """Patch the unpacked source in place (atomically)."""
    patch_file(src, FILE, patch_text)
