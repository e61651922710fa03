"""The repacked Q4_K kernel walks the weights 8 rows at a time in prompt chunks.

Why: prompt chunks spend most of their time in this kernel (`mul_mat_q4_k_r4_q8_k` in
`ggml/src/iqk/iqk_gemm_kquants.cpp`: 69% of a 256-token chunk on a 2-core Zen 5), which ran
at 0.45 of the CPU's int8 rate on weights in cache. The pinned kernel walks the weights 4
rows at a time, and every activation it shuffles into place feeds one dot product of those
4 rows. Walking two groups of 4 rows together lets each shuffled activation feed two, for
fewer instructions a product: a 256-token prompt chunk took 0.92 of the time, 16 tokens of
one request 0.97 (`experiments/ik_kernel_ab.py`, `experiments/results/ik-two-groups-epyc/`).

Only rows after a call's first group of 8 take this walk: they find the weights in cache.
The first group reads them from memory, which the pinned walk with its prefetch does better
(the two-group walk there made a round of 8 requests 8-11% slower), so rounds of a few rows
and a lone token are unchanged. Every row's integer sums and float operations are those of
the pinned kernel, in the same order: the logits stay bit for bit equal. Needs the prefetch
patch (`ik/patches/prefetch.py`), whose helper the two-group walk calls.
"""

from __future__ import annotations

from pathlib import Path

from adaspec.backends.ik.patches import prefetch as ik_prefetch_patch
from adaspec.backends.ik.source import PatchError, patch_file

NAME = "k-quant-two-groups"
FILE = ik_prefetch_patch.FILE
MARK = "adaspec_q4_k_r4_two_groups"

KERNEL = ik_prefetch_patch.HELPER_BEFORE  # the pinned x86 Q4_K kernel
LOOP = ("    for (int ix = 0; ix < nrc_x; ix += 4) {\n"
        "        const block_q4_k_r4 * iq4 = "
        "(const block_q4_k_r4 *)((const char *)vx + (ix+0)*bx);\n")
LOOP_FROM = f"    for (int ix = {MARK}<nrc_y>(n, vx, bx, info, nrc_x); ix < nrc_x; ix += 4) {{\n"
HELPER = (Path(__file__).parent / "ik_two_groups.cpp").read_text


def patch_text(text: str) -> str:
    """The kernels file with the two-group pass (unchanged when already there)."""
    if MARK in text:
        return text
    if ik_prefetch_patch.MARK not in text:
        raise PatchError(f"{FILE}: the prefetch patch goes first ({ik_prefetch_patch.NAME})")
    for anchor in (KERNEL, LOOP):
        if text.count(anchor) != 1:
            raise PatchError(f"{FILE}: expected one `{anchor.strip().splitlines()[0]}`, "
                             f"found {text.count(anchor)}")
    start = text.index(KERNEL)
    if text.index(LOOP) < start:
        raise PatchError(f"{FILE}: the Q4_K loop is not in `{KERNEL.splitlines()[1]}`")
    text = text.replace(KERNEL, HELPER() + KERNEL)
    return text.replace(LOOP, LOOP_FROM + LOOP.split("\n", 1)[1])


def apply(src: Path) -> None:
    """Patch the unpacked source in place (atomically)."""
    patch_file(src, FILE, patch_text)
