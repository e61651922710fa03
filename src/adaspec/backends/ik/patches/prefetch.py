"""The repacked Q4_K and Q6_K kernels fetch their next weights ahead while computing.

Why: a call of a few rows (requests decoded together, or a short verification block) reads
every weight once, for only 2-16 rows of work each, and the pinned ik_llama.cpp's x86
kernels (`ggml/src/iqk/iqk_gemm_kquants.cpp`) load the weights only when they use them. On a
2-core Zen 5 the hottest instruction of a round of 8 rows was a weight load, and the kernels
ran at a third of the CPU's int8 rate (`experiments/results/int8-roofline-epyc/`). Asking
for the block of 256 quants two blocks ahead (a software prefetch, which changes no
arithmetic: the logits stay bit for bit equal) took a round of one token for each of 8
requests from 86-88 to 78-80 ms, 8 tokens of one request from 80-83 to 72 and 16 from
146-148 to 137 (`experiments/ik_kernel_ab.py`, `experiments/results/ik-prefetch-epyc/`).

Only calls of two rows or more prefetch: a lone row is bound by memory bandwidth, which the
hardware prefetcher already keeps busy (prefetching it too showed no gain through the
machine's drift). A prompt chunk keeps its weights in cache between its groups of 8 rows,
so it neither gains nor loses.
"""

from __future__ import annotations

from pathlib import Path

from adaspec.backends.ik.source import PatchError, patch_file

NAME = "k-quant-prefetch"
FILE = "ggml/src/iqk/iqk_gemm_kquants.cpp"
MARK = "adaspec_prefetch_block"
BLOCKS_AHEAD = 2  # blocks of 256 quants (x 4 rows) between the one computed and the one fetched

HELPER = f"""// adaspec (k-quant-prefetch): a call of several rows asks for the weights
// {BLOCKS_AHEAD} blocks ahead of the one it computes (a hint only: no arithmetic
// changes); a lone row is left to the hardware prefetcher (adaspec's
// `backends/ik/patches/prefetch.py`).
template <int nrc_y, typename Block>
static inline void {MARK}(const Block * block) {{
    if constexpr (nrc_y > 1) {{
        const char * ahead = (const char *)(block + {BLOCKS_AHEAD});
        for (int k = 0; k < (int)sizeof(Block); k += 64) _mm_prefetch(ahead + k, _MM_HINT_T0);
    }}
}}
"""

# the helper goes before this kernel (the x86 section); a call before each block's first load
HELPER_BEFORE = "template <int nrc_y>\nstatic void mul_mat_q4_k_r4_q8_k("
CALLS = (
    ("            auto dl = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)iq4[ibl].d));\n",
     "iq4"),
    ("            auto dl = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)iq6[ibl].d));\n",
     "iq6"),
)


def _call(blocks: str) -> str:
    return f"            {MARK}<nrc_y>({blocks} + ibl);\n"


def patch_text(text: str) -> tuple[str, int]:
    """The kernels file with the prefetches (unchanged when already there); returns it and
    how many kernels prefetch."""
    if MARK in text:  # its own calls (the two-group patch adds one of its own)
        return text, sum(text.count(_call(blocks)) for _, blocks in CALLS)
    anchors = [HELPER_BEFORE] + [anchor for anchor, _ in CALLS]
    for anchor in anchors:
        if text.count(anchor) != 1:
            raise PatchError(f"{FILE}: expected one `{anchor.strip()}`, found "
                             f"{text.count(anchor)}")
    text = text.replace(HELPER_BEFORE, HELPER + HELPER_BEFORE)
    for anchor, blocks in CALLS:
        text = text.replace(anchor, _call(blocks) + anchor)
    return text, len(CALLS)


def apply(src: Path) -> int:
    """Patch the unpacked source in place (atomically); returns how many kernels prefetch."""
    return patch_text(patch_file(src, FILE, lambda text: patch_text(text)[0]))[1]
