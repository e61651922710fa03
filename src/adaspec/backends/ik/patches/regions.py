"""A region of the KV cache per sequence, and attention that reads only a row's own region.

Why: requests decoded together each add one token a round, and the pinned ik_llama.cpp puts a
call's tokens in consecutive free cells, so after a few rounds every block of cells holds
tokens of every sequence. A query row then reads all sequences' cells (the others masked):
with 8 requests of 300 cells, a decoding call of 8 rows took 120 ms against 87 ms for 8 rows
of one sequence (`experiments/ik_raw.py` probes, session 13).

Three source changes, switched on per context by `adaspec_kv_regions(ctx, stride)` (adaspec
calls it for a cache of several sequences with flash attention, `backends/ik/backend.py`):

- placement: sequence s's token at position p goes to cell s * stride + p, so a sequence's
  cells stay together whatever the others do. Where that cell is taken (a prefix shared
  with another sequence still holds it, or p is past the region) the token takes the next
  free cell past the regions (then any free cell): still right, since the mask is built
  from each cell's sequences and positions, only slower. The attended span ends at the last
  cell used, so regions are kept short (`backends/ik/backend.py`) and the cells past them take
  what does not fit. The cache's own compaction (defrag) would undo the layout, so adaspec
  turns it off with the regions;
- the store: a call's keys and values are written row by row to their cells
  (`ggml_set_rows` with the cells as an input), not as one run from the cache's head;
- attention (`iqk_flash_attn.cpp`), one path for every row (`-3` in NAME): every masked
  call attends one row at a time, the query heads that share a key/value head as one
  group, over the cache's blocks from cell 0, one thread per (row, key/value head). The
  pinned kernel picks its path by the call's shape (a lone row's cells split among the
  threads and summed after; a prompt's rows in groups whose blocks end where the last
  row's cells do), so a row scored alone, in a draft block or beside other sequences came
  out a few bits apart, and greedy speculation through a server parted from plain
  decoding at near-ties. Now a row's arithmetic depends only on its own cells and where
  they lie, and a region starts on a block boundary, so a sequence's row is bit for bit
  the same in any slot, in any call, and in a context of one sequence (which adaspec runs
  with one region too, `backends/ik/backend.py`). Until `-2` only calls whose rows needed
  different blocks took it (`ik_flash_patch`'s `adaspec_rows_apart`). Since `-4` a
  sequence's consecutive rows (8 to 64: a prompt chunk, a long draft block) are attended
  together, a query head at a time, each block of cells read once for the group: the same
  arithmetic per row (bit for bit, `tests/test_models_ikllama.py`), and attention's time
  on 600 new tokens after a 3,000-token history down by about 30% on the AVX2 EPYC
  (`experiments/attention_share.py`,
  `experiments/results/ik-rows-together-epyc-avx2/`);
- `adaspec_kv_seq_copy`: a prefix taken from another sequence is copied into the taker's
  region (keys and values, layer by layer), where `llama_kv_cache_seq_cp` would tag the
  giver's cells with both ids: read from another region its blocks would be cut elsewhere.
"""

from __future__ import annotations

from adaspec.backends.ik.source import Edit, PatchError, SourcePatch

__all__ = ["FILES", "MARK", "NAME", "PatchError", "apply", "patch_files"]

NAME = "kv-regions-5"
MARK = "adaspec (kv-regions)"




# (file, anchor, text, where): the text goes before or after the anchor, or replaces it (the
# anchor found exactly once)
_EDITS: list[Edit] = [
    ("src/llama-context.h", "    // computed before each graph build\n", """\
    // adaspec (kv-regions): sequence s's token at position p goes to cell s*adaspec_stride + p
    // (0: the usual consecutive placement); the cells of the last placed batch
    uint32_t adaspec_stride = 0;
    uint32_t adaspec_regions = 0;  // sequences 0 .. adaspec_regions - 1 have one
    std::vector<int64_t> adaspec_cells;

""", "before"),
    ("src/llama-context.h", "    struct ggml_tensor * inp_pos;         // I32 [n_batch]\n", """\
    struct ggml_tensor * adaspec_inp_cells = nullptr; // adaspec (kv-regions): I64 [n_batch]
""", "after"),
    ("src/llama.cpp", "static bool llama_kv_cache_find_slot(\n", """\
// adaspec (kv-regions): each token in its sequence's region, else in the first free cell of
// the cells past the regions, else in any free cell (the mask follows each cell's sequences
// and positions, so any free cell is right; past the regions keeps the attended span short);
// false, with nothing placed, when the cache is full.
static bool adaspec_place(struct llama_kv_cache & cache, const struct llama_batch & batch) {
    const uint32_t n = batch.n_tokens;
    cache.adaspec_cells.resize(n);
    const uint64_t regions_end = uint64_t(cache.adaspec_stride)*cache.adaspec_regions;
    uint32_t spare = uint32_t(std::min<uint64_t>(cache.size, regions_end) % cache.size);
    uint32_t tested = 0;
    for (uint32_t i = 0; i < n; ++i) {
        const llama_pos pos = batch.pos[i];
        const int64_t want = int64_t(batch.seq_id[i][0])*cache.adaspec_stride + pos;
        int64_t cell = -1;
        if (batch.seq_id[i][0] >= 0 && batch.seq_id[i][0] < (llama_seq_id)cache.adaspec_regions &&
            pos >= 0 && pos < (llama_pos)cache.adaspec_stride &&
            want < (int64_t)cache.size && cache.cells[want].pos < 0) {
            cell = want;
        }
        for (; cell < 0 && tested < cache.size; ++tested, spare = (spare + 1) % cache.size) {
            if (cache.cells[spare].pos < 0) cell = spare;
        }
        if (cell < 0) {
            for (uint32_t j = 0; j < i; ++j) {
                cache.cells[cache.adaspec_cells[j]].pos = -1;
                cache.cells[cache.adaspec_cells[j]].seq_id.clear();
            }
            return false;
        }
        cache.cells[cell].pos = pos;
        for (int32_t j = 0; j < batch.n_seq_id[i]; ++j) {
            cache.cells[cell].seq_id.insert(batch.seq_id[i][j]);
        }
        cache.adaspec_cells[i] = cell;
    }
    cache.used += n;
    cache.head = 0;
    return true;
}

""", "before"),
    ("src/llama.cpp", "    uint32_t n_tested = 0;\n", """\
    if (cache.adaspec_stride > 0) {
        return adaspec_place(cache, batch);
    }

""", "before"),
    # the attended cells end at the last one used: the padded search looks at one cell in
    # `pad`, which misses a region's cells when the cells below its end are free
    ("src/llama.cpp", "                auto max_cell = llama_kv_cache_cell_max(kv_self, pad);\n",
     """\
                auto max_cell = kv_self.adaspec_stride > 0 ? llama_kv_cache_cell_max(kv_self)
                                                           : llama_kv_cache_cell_max(kv_self, pad);
""", "replace"),
    ("src/llama.cpp", "    if (batch.pos && lctx.inp_pos) {\n", """\
    if (lctx.adaspec_inp_cells) {  // adaspec (kv-regions): the cells the batch's rows go to
        GGML_ASSERT((int64_t)lctx.kv_self.adaspec_cells.size() == (int64_t)batch.n_tokens);
        ggml_backend_tensor_set(lctx.adaspec_inp_cells, lctx.kv_self.adaspec_cells.data(), 0,
                                batch.n_tokens*sizeof(int64_t));
    }

""", "before"),
    ("src/llama-build-context.cpp", "    lctx.inp_pos         = nullptr;\n", """\
    lctx.adaspec_inp_cells = nullptr;
""", "after"),
    ("src/llama-build-context.cpp",
     "    if (k_cur) {\n        GGML_ASSERT(2*il+1 < (int)lctx.cache_copies.size());\n"
     "        auto k_row_size = ggml_row_size(kv.k_l[il]->type, n_embd_head_k);\n", """\
    // adaspec (kv-regions): rows written to the cells placement chose, one by one
    if (kv.adaspec_stride > 0 && !kv.v_trans && k_cur && v_cur && n_tokens > 0) {
        GGML_ASSERT(2*il+1 < (int)lctx.cache_copies.size());
        if (!lctx.adaspec_inp_cells) {
            lctx.adaspec_inp_cells = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_tokens);
            ggml_set_input(lctx.adaspec_inp_cells);
        }
        // one row of `width` values per cell: row i of `cur` to cell inp_cells[i]
        auto store = [&](ggml_tensor * cache, ggml_tensor * cur, int64_t width, int which) {
            ggml_tensor * rows = ggml_view_2d(ctx, cache, width, kv.size,
                    ggml_row_size(cache->type, width), 0);
            ggml_tensor * src = ggml_is_contiguous(cur) ? cur : ggml_cont(ctx, cur);
            lctx.cache_copies[2*il+which].cpy = ggml_set_rows(ctx, rows,
                    ggml_reshape_2d(ctx, src, width, n_tokens), lctx.adaspec_inp_cells);
            ggml_build_forward_expand(graph, lctx.cache_copies[2*il+which].cpy);
        };
        store(kv.k_l[il], k_cur, hparams.n_embd_k_gqa(il), 0);
        store(kv.v_l[il], v_cur, n_embd_v_gqa, 1);
        return;
    }

""", "before"),
    ("ggml/src/iqk/iqk_flash_attn.cpp", "    int first_k = 0, last_k = nek1;\n", """\
    // adaspec (kv-regions, one path): every masked call attends its rows over the cache's
    // blocks from cell 0 (a region starts on a block boundary), in one of two forms. Rows
    // together: up to 64 consecutive rows that see the same first cell (one sequence's: a
    // prompt chunk, a draft block of 8 or more) are attended as a group, one query head a
    // thread, so each block of cells is read once for the group. Rows apart: a lone row, a
    // short block, rows of different sequences: one row at a time, the query heads sharing a
    // key/value head as one group, one (row, key/value head) a thread. A row's arithmetic is
    // the same in both forms (its products over the head size, and its sums over the cells
    // in one order; a block hidden from it adds exact zeros), so the form changes a row's
    // time, never its bits, and a row is the same whatever the call carries: a lone token, a
    // draft block, a prompt chunk or rows of other sequences beside it. The pinned kernel
    // picks its path by the call's shape (a lone row's cells split among threads and summed
    // after, a prompt's rows in groups whose blocks end where the last row's cells do), which
    // scored a row a few bits apart from one call to the next.
    if (neq3 == 1 && rk2 > 1 && rk2 == rv2 && mask && !sinks) {
        constexpr int kRows = 64, kTogether = 8;
        constexpr uint16_t kHidden = 0xFC00;  // fp16 -inf: a cell the row does not see
        auto mask_row = [&](int iq1) {
            return (const uint16_t *)((const char *)mask + (long)iq1*stride_m);
        };
        long done = 0;  // items of the groups before: item i is thread i % nth's
        for (int i0 = 0; i0 < neq1; ) {
            const uint16_t * m0 = mask_row(i0);
            int first = 0;
            for (; first < nek1 && m0[first] == kHidden; ++first);
            int n = 1;
            for (; n < kRows && i0 + n < neq1 && first < nek1 && mask_row(i0 + n)[first] != kHidden;
                 ++n);
            const bool together = n >= kTogether;
            const long items = together ? (long)neq2 : (long)n*nek2;
            for (long u = ((ith - done)%nth + nth)%nth; u < items; u += nth) {
                const int iq1 = together ? i0 : i0 + (int)(u/nek2);
                const int iq2 = together ? (int)u : (int)(u%nek2)*rk2;  // first query head
                const int ik02 = iq2/rk2;
                if (!iqk_flash_attn_impl(int_type_k_in, int_type_v, Dk, Dv, together ? n : rk2,
                        nek1, together ? stride_q : (int)nbq2, stride_k, stride_v,
                        together ? stride_m : 0, (together ? ne1*nb1 : nb1)/sizeof(float),
                        (const float *)((const char *)q + (long)iq1*stride_q + iq2*nbq2),
                        (const void *)((const char *)k + ik02*nbk2),
                        (const void *)((const char *)v + ik02*nbv2),
                        (const void *)mask_row(iq1), nullptr, 0, scale, softcap,
                        (float *)((char *)qkv + ((long)iq1*ne1 + iq2)*nb1),
                        nullptr, nullptr)) return false;
            }
            done += items;
            i0 += n;
        }
        return true;
    }

""", "before"),
]

_EXPORT = """
// adaspec (kv-regions): a region of `stride` cells per sequence from the next call on, the
// cells past them shared (0: the usual placement). Needs the keys and values stored by rows
// (flash attention); 0 on success.
extern "C" __attribute__((visibility("default")))
int adaspec_kv_regions(struct llama_context * ctx, uint32_t stride) {
    if (ctx == nullptr || ctx->kv_self.recurrent || ctx->kv_self.v_trans) return 1;
    ctx->kv_self.adaspec_stride = stride;
    ctx->kv_self.adaspec_regions = stride > 0 ? ctx->cparams.n_seq_max : 0;
    return 0;
}

// adaspec (kv-regions): cell `to` gets cell `from`'s keys and values, layer by layer (its
// position and sequences are the caller's to set)
static void adaspec_copy_cell(struct llama_context * ctx, int64_t from, int64_t to) {
    auto & cache = ctx->kv_self;
    const auto & hparams = ctx->model.hparams;
    std::vector<uint8_t> row;
    for (size_t il = 0; il < cache.k_l.size(); ++il) {
        for (int which = 0; which < 2; ++which) {
            ggml_tensor * t = which == 0 ? cache.k_l[il] : cache.v_l[il];
            if (t == nullptr) continue;
            const size_t width = which == 0 ? hparams.n_embd_k_gqa(il) : hparams.n_embd_v_gqa(il);
            const size_t bytes = ggml_row_size(t->type, width);
            row.resize(bytes);
            ggml_backend_tensor_get(t, row.data(), from*bytes, bytes);
            ggml_backend_tensor_set(t, row.data(), to*bytes, bytes);
        }
    }
}

// adaspec (kv-regions): sequence `dst` (its cells free) gets copies of sequence `src`'s
// positions 0 .. length - 1, keys and values, in its own region's cells, where a shared
// entry (llama_kv_cache_seq_cp) would stay in src's region: a row then reads its cells in
// the blocks it would have computed them in. 0 on success; nonzero, with nothing changed,
// where the cells are not all there (the caller shares them instead).
extern "C" __attribute__((visibility("default")))
int adaspec_kv_seq_copy(struct llama_context * ctx, int32_t src, int32_t dst, int32_t length) {
    if (ctx == nullptr) return 1;
    auto & cache = ctx->kv_self;
    const int64_t stride = cache.adaspec_stride;
    if (stride == 0 || cache.v_trans || cache.recurrent || length <= 0 || length > stride ||
        dst < 0 || dst >= (int32_t)cache.adaspec_regions || src == dst) return 2;
    if ((dst + 1)*stride > (int64_t)cache.size) return 3;
    std::vector<int64_t> from(length, -1);
    for (uint32_t i = 0; i < cache.size; ++i) {
        const llama_pos p = cache.cells[i].pos;
        if (p >= 0 && p < length && cache.cells[i].has_seq_id(src)) from[p] = i;
    }
    for (int32_t p = 0; p < length; ++p) {
        if (from[p] < 0 || cache.cells[dst*stride + p].pos >= 0) return 4;
    }
    for (int32_t p = 0; p < length; ++p) {
        adaspec_copy_cell(ctx, from[p], dst*stride + p);
    }
    for (int32_t p = 0; p < length; ++p) {
        auto & cell = cache.cells[dst*stride + p];
        cell.pos = p;
        cell.seq_id.clear();
        cell.seq_id.insert(dst);
    }
    cache.used += length;
    return 0;
}
"""


_PATCH = SourcePatch(_EDITS, MARK, _EXPORT)
patch_files = _PATCH.patch_files
apply = _PATCH.apply
FILES = _PATCH.files
