"""A token tree scored in one call, each node's row bit for bit the row a chain would give it.

Why: a tree of draft candidates (several tokens at one position) is verified in one target
pass where a chain verifies one candidate per position. The pinned ik_llama.cpp builds each
row's mask from the cells' sequences and positions, so siblings (same position) would see
each other, and it places a sequence's token at position p in one cell (`kv-regions`), so
siblings could not all sit where a chain puts its tokens.

Four changes, on top of `kv-regions` (it needs the regions and the keys and values stored
row by row):

- `adaspec_tree(ctx, parents, n)` arms the next call as a tree of n tokens: token 0 the root
  (the last accepted token), parents[i] < i each token's parent in the call; `(NULL, 0)`
  disarms. Placement: token i goes to cell region + root position + i (the chain's cell of
  the root, then one cell per node), or the call fails with nothing placed;
- the mask: a token sees a cell of its own call only when that cell holds an ancestor of it
  (or itself); cached cells as before;
- attention (`iqk_fa_templates.h`): a block of cells that hides some of them from a row sums
  the row's softmax weights one cell at a time, in cell order, where the pinned kernel sums
  them in a vector tree whose pairing follows each cell's place in the block (hidden cells
  add exact zeros either way; the values times the weights were already summed cell by
  cell). A node's visible cells are then those of the chain through it, in the same order
  and the same block of 128 cells (the caller keeps a tree inside the root's block), so its
  row is the chain's bit for bit; full blocks keep the vector sum;
- `adaspec_kv_tree_keep(ctx, seq, root_pos, n, keep, k)`: after the verdict, the accepted
  nodes (keep, one per depth, ascending) move to the cells a chain would have put them in
  (keys and values copied layer by layer) and the other nodes' cells are freed: the cache is
  then bit for bit what plain decoding of the accepted tokens leaves.
"""

from __future__ import annotations

from adaspec.backends.ik.source import Edit, PatchError, SourcePatch

__all__ = ["FILES", "MARK", "NAME", "PatchError", "apply", "patch_files"]

NAME = "kv-tree-1"
MARK = "adaspec (kv-tree)"
# the flash-attention kernel's block of cells: a tree lies in the root's block
BLOCK = 128




_EDITS: list[Edit] = [
    ("src/llama-context.h", "    std::vector<int64_t> adaspec_cells;\n", """\
    // adaspec (kv-tree): the parent of each token of the next call, a token tree (empty: none)
    std::vector<int32_t> adaspec_tree;
""", "after"),
    ("src/llama.cpp",
     "        const int64_t want = int64_t(batch.seq_id[i][0])*cache.adaspec_stride + pos;\n",
     """\
        // adaspec (kv-tree): a tree's token i goes to the root's cell + i, or nowhere
        const bool tree = cache.adaspec_tree.size() == n;
        const llama_pos at = tree ? batch.pos[0] + (llama_pos)i : pos;
        const int64_t want = int64_t(batch.seq_id[i][0])*cache.adaspec_stride + at;
""", "replace"),
    ("src/llama.cpp", "            pos >= 0 && pos < (llama_pos)cache.adaspec_stride &&\n",
     "            at >= 0 && at < (llama_pos)cache.adaspec_stride &&\n", "replace"),
    ("src/llama.cpp",
     "        for (; cell < 0 && tested < cache.size; ++tested, "
     "spare = (spare + 1) % cache.size) {\n",
     "        for (; cell < 0 && !tree && tested < cache.size; ++tested, "
     "spare = (spare + 1) % cache.size) {\n", "replace"),
    ("src/llama.cpp",
     '            printf("set_inputs(mask1): %d us\\n", int(tim2-tim1));\n#endif\n',
     """\
            // adaspec (kv-tree): a tree's token sees its call's cells of its ancestors only
            if (kv_self.adaspec_tree.size() == (size_t)n_tokens &&
                kv_self.adaspec_cells.size() == (size_t)n_tokens && (data || data_f16)) {
                const auto & parent = kv_self.adaspec_tree;
                std::vector<char> seen(n_tokens);
                for (int64_t j = 0; j < n_tokens; ++j) {
                    std::fill(seen.begin(), seen.end(), 0);
                    for (int64_t a = j; a >= 0; a = parent[a]) seen[a] = 1;
                    for (int64_t i = 0; i < n_tokens; ++i) {
                        if (seen[i]) continue;
                        const int64_t cell = kv_self.adaspec_cells[i];
                        if (cell < 0 || cell >= n_kv) continue;
                        if (data) data[j*n_kv + cell] = -INFINITY;
                        if (data_f16) data_f16[j*n_kv + cell] = ggml_fp32_to_fp16(-INFINITY);
                    }
                }
            }
""", "after"),
    ("ggml/src/iqk/fa/iqk_fa_templates.h", """\
    inline void update_M_S(int j, F16::Data * vk, const char * mask) {
        float smax = load_apply_mask_and_scale(j, vk, mask);
        update_M(j, smax);
        if (M[j] > -INFINITY) update_S(j, vk);
    }
""", """\
    inline void update_M_S(int j, F16::Data * vk, const char * mask) {
        float smax = load_apply_mask_and_scale(j, vk, mask);
        update_M(j, smax);
        if (M[j] > -INFINITY) {
            // adaspec (kv-tree): a block hiding some cells from the row sums its weights cell
            // by cell, so the sum follows the visible cells' order, not their places
            uint16_t hidden = 0;
            for (int l = 0; l < k_step; ++l) {
                uint16_t m;
                std::memcpy(&m, mask + 2*l, sizeof(m));
                hidden |= m;
            }
            if (hidden) {
                auto vm = F16::set1(M[j]);
                for (int l = 0; l < k_step/F16::block_size; ++l) {
                    vk[l] = v_expf(F16::sub(vk[l], vm));
                    F16::store(cache + k_step*j + F16::block_size*l, vk[l]);
                }
                float s = 0;
                for (int l = 0; l < k_step; ++l) s += cache[k_step*j + l];
                S[j] += s;
            } else {
                update_S(j, vk);
            }
        }
    }
""", "replace"),
]

_EXPORT = """
// adaspec (kv-tree): the next call is a token tree: parent[i] < i the parent of its token i
// (parent[0] = -1, the root); n = 0 disarms. 0 on success.
extern "C" __attribute__((visibility("default")))
int adaspec_tree(struct llama_context * ctx, const int32_t * parent, int32_t n) {
    if (ctx == nullptr || n < 0) return 1;
    auto & cache = ctx->kv_self;
    cache.adaspec_tree.clear();
    if (n == 0) return 0;
    if (cache.adaspec_stride == 0 || parent == nullptr || parent[0] != -1) return 2;
    for (int32_t i = 1; i < n; ++i) {
        if (parent[i] < 0 || parent[i] >= i) return 3;
    }
    cache.adaspec_tree.assign(parent, parent + n);
    return 0;
}

// adaspec (kv-tree): after a tree of n tokens placed at sequence `seq`'s cells from its root
// at `root_pos`: keep[d] (ascending, d < k) the kept node at depth d + 1, moved to the cell
// a chain puts position root_pos + 1 + d in; the other nodes' cells freed. 0 on success.
extern "C" __attribute__((visibility("default")))
int adaspec_kv_tree_keep(struct llama_context * ctx, int32_t seq, int32_t root_pos, int32_t n,
                         const int32_t * keep, int32_t k) {
    if (ctx == nullptr) return 1;
    auto & cache = ctx->kv_self;
    const int64_t stride = cache.adaspec_stride;
    if (stride == 0 || seq < 0 || seq >= (int32_t)cache.adaspec_regions || n < 1 || k < 0 ||
        k >= n || root_pos < 0 || root_pos + n > stride) return 2;
    const int64_t base = seq*stride + root_pos;
    if (base + n > (int64_t)cache.size) return 3;
    for (int32_t d = 0; d < k; ++d) {
        if (keep[d] <= d || keep[d] >= n || (d > 0 && keep[d] <= keep[d - 1])) return 4;
    }
    for (int32_t i = 0; i < n; ++i) {
        if (cache.cells[base + i].pos < 0 || !cache.cells[base + i].has_seq_id(seq)) return 5;
    }
    for (int32_t d = 0; d < k; ++d) {
        if (keep[d] == 1 + d) continue;
        adaspec_copy_cell(ctx, base + keep[d], base + 1 + d);  // the kv-regions patch's
        cache.cells[base + 1 + d].pos = root_pos + 1 + d;
    }
    for (int32_t i = 1 + k; i < n; ++i) {
        cache.cells[base + i].pos = -1;
        cache.cells[base + i].seq_id.clear();
    }
    cache.used -= n - 1 - k;
    return 0;
}
"""


_PATCH = SourcePatch(_EDITS, MARK, _EXPORT)
patch_files = _PATCH.patch_files
apply = _PATCH.apply
FILES = _PATCH.files
