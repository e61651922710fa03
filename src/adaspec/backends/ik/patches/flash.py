"""ik_llama.cpp's CPU flash attention made right, and fast, for several sequences in one cache.

Continuous batching keeps every request's tokens in one KV cache (`n_seq_max` > 1): a query
row attends only to its own sequence's cells, the others are masked. Two things in the pinned
ik_llama.cpp's flash-attention kernel (`ggml/src/iqk/fa/iqk_fa_templates.h`) assume one
sequence:

- it attends a group of query rows up to the last cell the group's *last* row sees. Right
  for one causal sequence; with several, rows of another sequence lose their cells past that
  point (on a Zen 5 the library aborted with `GGML_ASSERT(S > 0)` once requests had left and
  others had taken their cells). Replaced: a block of cells is skipped when the mask hides
  it from every row of the group, wherever it lies. A hidden block adds nothing (its
  weights are exp(-inf) = 0 and the kernel adds them as exact zeros), so the rows come out
  bit for bit as without the skip;
- it attends the group's rows together, over every block any of them needs: 8 decoding
  requests in one call each read all 8 sequences' cells. Now a group whose rows need less
  than half of that one at a time is attended row by row, each over its own blocks (the
  kernel's own one-row path, which scores a row bit for bit as the group path does).

The test for a hidden block runs for every row, head and layer over the whole cache. Since
`-2` in NAME it reads the mask four halves at a time, which vectorizes: with 8 sequences of
500 cells a decoding call took 123 ms with a scan of one half at a time and 103 ms with this
one (session 12, `experiments/results/concurrency-sweep-epyc-fa2/`). Since `-3`, rows that
share one mask row (a token's query heads, `ik_regions_patch`) read it once. Since `-4`, the
two mask readers live in `iqk_flash_impl.h` (`SHARED`), which both the kernel's header and
`iqk_flash_attn.cpp` include, so `ik_regions_patch` calls them instead of keeping a copy.
Since `-5` a call of 5-7 rows runs as one group with rows left over (`_FEW_ROWS`): a decoding
row of the built-in target (6 query heads per key/value head) read the cells twice, as 4
rows and then 2; attention's time on a lone row after 3,000 tokens fell by about 14%
(`experiments/attention_share.py`). A new NAME makes older builds rebuild.

Without flash attention (adaspec's setting for one sequence) the cache's whole length is
scored for every row and masked after: with 8 requests of 512 cells, a prompt chunk of 256
tokens took 2.6-2.8 s against 1.75 s with these changes (`experiments/ik_attention.py`).
`backends/ik/backend.py` turns flash attention on for a cache of several sequences only when
the library was built with this patch (`build.json`'s `patches`).
"""

from __future__ import annotations

import re
from pathlib import Path

NAME = "fa-multi-sequence-5"
FILE = "ggml/src/iqk/fa/iqk_fa_templates.h"
IMPL = "ggml/src/iqk/iqk_flash_impl.h"  # included by the kernel's header and its caller
MARK = "adaspec_block_masked"
_IMPL_ANCHOR = "#include <cstdint>\n"

SHARED = r"""#include <cstring>
// adaspec (fa-multi-sequence): a block of cells the mask hides from every row of a
// group adds nothing (exp(-inf) = 0, added as exact zeros), so it is skipped wherever it is.
// A row's block is read four halves at a time and without an early exit, so the compiler
// vectorizes it: every call scans each row's mask over the whole cache, for every head and
// layer (adaspec's `backends/ik/patches/flash.py`).
static inline bool adaspec_block_masked(const char * mr, int stride_m, int nq, int k_step) {
    const uint64_t ninf = 0xFC00FC00FC00FC00ull;  // four fp16 -inf
    for (int j = 0; j < nq; ++j) {
        const char * m = mr + j*stride_m;
        uint64_t seen = 0;
        for (int l = 0; l < k_step/4; ++l) {
            uint64_t w;
            std::memcpy(&w, m + 8*l, sizeof(w));
            seen |= w ^ ninf;
        }
        if (seen) return false;
    }
    return true;
}
// Rows of different sequences need different blocks (fp16 cells, k_step a block): attended
// one at a time they read at most half of what the group reads (every block any row needs,
// for all its rows).
static inline bool adaspec_rows_apart(const void * mask, int stride_m, int nq, int nk1,
                                      int k_step) {
    if (stride_m == 0) return false;  // one mask row for all: the same blocks
    long all = 0, own = 0;
    for (int b = 0; b < nk1/k_step; ++b) {
        int need = 0;
        for (int j = 0; j < nq; ++j) {
            need += !adaspec_block_masked((const char *)mask + (long)j*stride_m + 2L*b*k_step,
                                          stride_m, 1, k_step);
        }
        all += need > 0;
        own += need;
    }
    return 2*own <= all*nq;
}
"""

_HELPERS = r"""#include "iqk/iqk_flash_impl.h"  // adaspec: adaspec_block_masked, adaspec_rows_apart
// (rows with one mask row, stride_m 0: the query heads of one token, read once)
#define ADASPEC_SKIP_MASKED(NQ) \
    if (adaspec_block_masked(mr, stride_m, stride_m ? NQ : 1, k_step)) { \
        kh.next_block(k_step); vh.next_block(k_step); mr += k_step*sizeof(ggml_half); continue; }
"""

_HELPER_ANCHOR = ("template <int Dk, int Dv, int q_step, int k_step, typename KHelper, "
                  "typename VHelper, typename KQHelper>\nvoid compute_helper(")

# the group's range cut at the last row's last cell -> every block, hidden ones skipped
_TRIM = re.compile(r"int ik = nk1 - k_step;\n\s*for \(; ik >=0 && Mc\[ik\] != 0; ik -= k_step\);\n"
                   r"\s*ik \+= k_step;\n(\s*)for \(int k1 = 0; k1 < ik/k_step; \+\+k1\) \{\n")
# the rows left over after the groups: hidden blocks skipped too
_LEFT = re.compile(r"\n(\s*)for \(int k1 = 0; k1 < nk1/k_step; \+\+k1\) \{\n")

_GROUP_LOOP = """    for (int i1 = 0; i1 < nq1/q_step; ++i1) {
        fms.init_qstep();
        kh.reset_block();
        vh.reset_block();
#ifdef __aarch64__
        KQHelper::convert(q_step, stride_q, q, q_f16);
#endif
"""
_ROW_BY_ROW = """    for (int i1 = 0; i1 < nq1/q_step; ++i1) {
#ifndef __aarch64__
        if (q_step > 1 && adaspec_rows_apart(mask, stride_m, q_step, nk1, k_step)) {
            for (int j = 0; j < q_step; ++j) {
                fms.init_qstep();
                kh.reset_block();
                vh.reset_block();
                auto mr = mask + j*stride_m;
                for (int k1 = 0; k1 < nk1/k_step; ++k1) {
                    ADASPEC_SKIP_MASKED(1)
                    KQHelper::multiply_mask_kq(1, kh, stride_q, stride_m, q + j*stride_q, mr, fms);
                    fqkv.accumulate_qkv(1, vh, fms);
                    kh.next_block(k_step);
                    vh.next_block(k_step);
                    mr += k_step*sizeof(ggml_half);
                }
                fqkv.normalize_and_store(fms, 1, stride_qkv, qkv + j*stride_qkv, sinkf,
                                         M && S ? M + j : nullptr, M && S ? S + j : nullptr);
            }
            q    += q_step*stride_q;
            mask += q_step*stride_m;
            qkv  += q_step*stride_qkv;
            if (M && S) { M += q_step; S += q_step; }
            continue;
        }
#endif
        fms.init_qstep();
        kh.reset_block();
        vh.reset_block();
#ifdef __aarch64__
        KQHelper::convert(q_step, stride_q, q, q_f16);
#endif
"""


class PatchError(Exception):
    """The source lacks what this patch expects (another ik_llama.cpp version)."""


# 5-7 rows (a token's query heads sharing a key/value head, the regions patch's rows apart:
# 6 for the built-in target) in one pass over the cells, where the pinned helper ran a group
# of 4 and then the rest, reading every block twice. Each row's arithmetic is unchanged (the
# rows left over after no group take the same products and sums in the same order).
_FEW_ROWS_ANCHOR = """    if (nq1 == 12) {
        // Special case: TG for GLM-4.5/4.6
"""
_FEW_ROWS = """    if (nq1 > 4 && nq1 < 8) {  // adaspec (fa-multi-sequence-5): one pass, 5-7 rows
        FlashAttn<Dk, Dv, 8, k_step> fa(scale, softcap, sinkf);
        fa.compute(kh, vh, nq1, nk1, stride_q, stride_m, stride_qkv, q, (const char *)mask,
                   qkv, M, S);
        return;
    }
"""


def patch_impl(text: str) -> str:
    """`iqk_flash_impl.h` with the shared mask readers; text already patched comes back
    unchanged."""
    if MARK in text:
        return text
    if text.count(_IMPL_ANCHOR) != 1:
        raise PatchError(f"{IMPL}: no `#include <cstdint>` to put the mask readers after")
    return text.replace(_IMPL_ANCHOR, _IMPL_ANCHOR + SHARED, 1)


def patch_text(text: str) -> tuple[str, int]:
    """The header with the patch applied, and how many block loops now skip hidden blocks;
    text already patched comes back unchanged."""
    if "ADASPEC_SKIP_MASKED" in text:
        return text, text.count("ADASPEC_SKIP_MASKED(q_step)") + text.count(
            "ADASPEC_SKIP_MASKED(n_left)")
    if text.count(_HELPER_ANCHOR) != 1:
        raise PatchError(f"{FILE}: no compute_helper to patch")
    if text.find(_GROUP_LOOP, text.index(_HELPER_ANCHOR)) < 0:
        raise PatchError(f"{FILE}: compute_helper's group loop is not the expected one")
    text, trims = _TRIM.subn(
        lambda m: f"int ik = nk1; (void)Mc;\n{m.group(1)}for (int k1 = 0; k1 < ik/k_step; "
                  f"++k1) {{\n{m.group(1)}    ADASPEC_SKIP_MASKED(q_step)\n", text)
    text, lefts = _LEFT.subn(
        lambda m: f"{m.group(0)}{m.group(1)}    ADASPEC_SKIP_MASKED(n_left)\n", text)
    if trims == 0 or lefts == 0:
        raise PatchError(f"{FILE}: the block loops are not the expected ones")
    if text.count(_FEW_ROWS_ANCHOR) != 1:
        raise PatchError(f"{FILE}: iqk_flash_helper's row counts are not the expected ones")
    text = text.replace(_FEW_ROWS_ANCHOR, _FEW_ROWS + _FEW_ROWS_ANCHOR)
    start = text.index(_HELPER_ANCHOR)
    at = text.index(_GROUP_LOOP, start)
    text = text[:at] + _ROW_BY_ROW + text[at + len(_GROUP_LOOP):]
    text = text[:start] + _HELPERS + text[start:]
    return text, trims + lefts


def apply(src: Path) -> int:
    """Patch the unpacked source in place (atomically); returns the loops patched."""
    from adaspec.store.atomic import write_text

    texts = {}
    for name in (IMPL, FILE):
        try:
            texts[name] = (src / name).read_text()
        except OSError as exc:
            raise PatchError(f"{src / name} unreadable ({exc})") from None
    impl = patch_impl(texts[IMPL])
    patched, loops = patch_text(texts[FILE])
    for name, new in ((IMPL, impl), (FILE, patched)):
        if new != texts[name]:
            write_text(src / name, new)
    return loops
