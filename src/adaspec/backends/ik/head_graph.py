"""A draft head's layer as a one-block GGUF model run by ik_llama.cpp, fed embedding rows
(what `head:weights=ggml` drafts with, `draft/head_ggml.py`).

The head's decoder layer, final norm and kept output rows are a one-block llama model whose
input is an embedding row; the model returns the final-normed state beside the logits through
the `target-features` patch. Qwen2 rotates each head's halves where llama's rope takes
adjacent pairs, so q and k rows are reordered at export.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adaspec.errors import AdaspecError, InputError

QUANT = "Q8_0"  # the weights' format in the GGUF (Q4_0 measured no faster after a target call)
CONTEXT = 32768  # head positions a context holds (1 KB of cache each), its sequences together
SEQUENCES = 8  # requests' caches one context holds
BATCH = 512  # rows a decode takes


def gguf_file(digest: str, target: str) -> Path:
    """Where the GGUF of the head whose file hashes to `digest` is cached over `target`'s
    output rows (a retrained head gets another file)."""
    from adaspec.store.assembly import adaspec_home

    return adaspec_home() / "heads" / "ggml" / f"{target}-{digest}-{QUANT.lower()}.gguf"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Qwen2 rotates each head's two halves, llama's rope adjacent pairs: q and k rows
    reordered so that llama's rope gives Qwen2's attention scores."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def export(cfg: Any, state: dict[str, torch.Tensor], rows: torch.Tensor, out: Path) -> None:
    """Write a head's layer and final norm (`state`, a `DraftHead`'s, config `cfg`) and its
    output rows [N, H] as a one-block llama GGUF (atomically)."""
    import gguf

    if cfg.head_dim < 16:  # measured: head size 8 scores attention wrong, 16 to 128 right
        raise InputError(f"weights=ggml runs heads of head size 16 or more, not {cfg.head_dim}")
    if cfg.features != 1:
        raise InputError("weights=ggml runs heads over the target's last feature only "
                         f"(this head fuses {cfg.features})")
    sd = {k: v.float().numpy() for k, v in state.items()
          if k.startswith("layer.") or k == "norm.weight"}
    qtype = getattr(gguf.GGMLQuantizationType, QUANT)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.part")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_block_count(1)
    w.add_context_length(32768)
    w.add_embedding_length(cfg.hidden)
    w.add_feed_forward_length(cfg.intermediate)
    w.add_head_count(cfg.heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_vocab_size(int(rows.shape[0]))
    w.add_tokenizer_model("none")  # fed embeddings, never tokens

    def mat(name: str, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a, np.float32)
        if a.shape[-1] % 32:  # Q8_0 packs rows by 32: a tiny head's odd rows in f16
            w.add_tensor(name, a.astype(np.float16))
            return
        w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    def vec(name: str, a: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(a, np.float32))

    lay = "layer."
    mat("token_embd.weight", rows.float().numpy())  # tied: the output head
    vec("output_norm.weight", sd["norm.weight"])
    vec("blk.0.attn_norm.weight", sd[lay + "input_norm.weight"])
    mat("blk.0.attn_q.weight", _permute(sd[lay + "q.weight"], cfg.heads))
    vec("blk.0.attn_q.bias", _permute(sd[lay + "q.bias"], cfg.heads))
    mat("blk.0.attn_k.weight", _permute(sd[lay + "k.weight"], cfg.kv_heads))
    vec("blk.0.attn_k.bias", _permute(sd[lay + "k.bias"], cfg.kv_heads))
    mat("blk.0.attn_v.weight", sd[lay + "v.weight"])
    vec("blk.0.attn_v.bias", sd[lay + "v.bias"])
    mat("blk.0.attn_output.weight", sd[lay + "o.weight"])
    vec("blk.0.ffn_norm.weight", sd[lay + "post_norm.weight"])
    mat("blk.0.ffn_gate.weight", sd[lay + "gate.weight"])
    mat("blk.0.ffn_up.weight", sd[lay + "up.weight"])
    mat("blk.0.ffn_down.weight", sd[lay + "down.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)  # the same folder: whole or absent


def _library() -> Any:
    """ik_llama.cpp in this process, its OpenMP threads spinning as briefly as the
    children's (`core/openmp.py`: they share the cores with the target's child)."""
    from adaspec.backends.ik.backend import library
    from adaspec.core.openmp import spin_settings

    added = spin_settings(os.environ)
    os.environ.update(added)
    try:
        return library()
    finally:
        for name in added:
            os.environ.pop(name, None)


class _Shared:
    """One llama context of the head holding `SEQUENCES` sequences (the requests' caches):
    its buffers (31-44 MB with a context of its own each) are shared; calls are serialized."""

    def __init__(self, lib: Any, model: int, hidden: int) -> None:
        self.lib = lib
        cp = lib.llama_context_default_params()
        cp.n_ctx = CONTEXT
        cp.n_batch = cp.n_ubatch = BATCH
        cp.n_seq_max = SEQUENCES
        cp.n_threads = cp.n_threads_batch = torch.get_num_threads()
        cp.flash_attn = False
        cp.logits_all = False
        self.ctx = lib.llama_init_from_model(model, cp)
        if not self.ctx:
            raise AdaspecError("ik_llama.cpp could not create a context for the draft head")
        lib.adaspec_features(self.ctx, True)
        self.rows = int(lib.llama_n_batch(self.ctx))  # at most BATCH: the context's own cap
        self.batch = lib.llama_batch_init(BATCH, hidden, 1)
        for i in range(BATCH):
            self.batch.n_seq_id[i] = 1
        self.lock = threading.Lock()
        self.free = list(range(SEQUENCES - 1, -1, -1))  # sequence ids not handed out
        # ik_llama.cpp reads the token of a context's first lone row (its warm-up check):
        # a token row first, its logits read (which counts it), then removed
        tok = lib.llama_batch_init(1, 0, 1)
        tok.token[0], tok.pos[0], tok.n_seq_id[0], tok.logits[0], tok.n_tokens = 0, 0, 1, 1, 1
        tok.seq_id[0][0] = 0
        try:
            if lib.llama_decode(self.ctx, tok) != 0:
                raise AdaspecError("ik_llama.cpp could not run the draft head")
            lib.llama_get_logits(self.ctx)
        finally:
            lib.llama_batch_free(tok)
        lib.llama_kv_cache_seq_rm(self.ctx, 0, 0, -1)

    def close(self) -> None:
        """Free the context and its batch (its model's `GgmlHead` is going)."""
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


class HeadContext:
    """One request's KV cache of the head: a sequence of a shared context."""

    def __init__(self, shared: _Shared, seq: int, hidden: int, vocab: int) -> None:
        self._shared, self.seq, self.hidden, self.vocab = shared, seq, hidden, vocab

    def remove_from(self, position: int) -> None:
        sh = self._shared
        with sh.lock:
            sh.lib.llama_kv_cache_seq_rm(sh.ctx, self.seq, position, -1)

    def decode(self, rows: torch.Tensor, positions: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Feed rows [T, H] (fc's outputs) at `positions`; the last row's final-normed state
        [1, 1, H] and its kept-token logits [N], or None where the cache is full."""
        sh = self._shared
        lib, batch = sh.lib, sh.batch
        data = np.ascontiguousarray(rows.float().numpy(), np.float32)
        with sh.lock:
            for start in range(0, len(positions), sh.rows):
                n = min(sh.rows, len(positions) - start)
                ctypes.memmove(batch.embd, data[start:].ctypes.data, n * self.hidden * 4)
                for i in range(n):
                    batch.pos[i] = positions[start + i]
                    batch.seq_id[i][0] = self.seq
                    batch.logits[i] = start + i == len(positions) - 1
                batch.n_tokens = n
                if lib.llama_decode(sh.ctx, batch) != 0:
                    lib.llama_kv_cache_seq_rm(sh.ctx, self.seq, positions[0], -1)
                    return None
            logits = np.ctypeslib.as_array(lib.llama_get_logits(sh.ctx), shape=(self.vocab,))
            state = np.ctypeslib.as_array(lib.llama_get_embeddings(sh.ctx),
                                          shape=(self.hidden,))
            return (torch.from_numpy(state.copy()).view(1, 1, -1),
                    torch.from_numpy(logits.copy()))


class GgmlHead:
    """The model of one head's GGUF and a pool of its contexts (a server builds a drafter
    per request; each takes a context and gives it back when it goes)."""

    def __init__(self, path: Path, hidden: int) -> None:
        from adaspec.backends.ik.backend import load_model, target_features

        api = _library()
        if not target_features(api):
            raise InputError("weights=ggml needs the ik_llama.cpp library `adaspec runtime "
                             "build` makes (its target-features patch)")
        lib = self._lib = api.adaspec_lib
        self.model = load_model(lib, path)
        if not self.model:
            raise AdaspecError(f"ik_llama.cpp could not load the draft head {path}")
        self.hidden = hidden
        self.vocab = int(lib.llama_n_vocab(self.model))
        self._shared: list[_Shared] = []
        self._lock = threading.Lock()
        # a head nothing drafts with any more (online learning published another) frees its
        # contexts and model (at exit the process goes anyway)
        weakref.finalize(self, _free, lib, self.model, self._shared).atexit = False

    def prewarm(self) -> None:
        """Make its first context now (30-45 MB, a warm-up call), so the first request that
        drafts with this head does not wait for it."""
        self.release(self.acquire())

    def acquire(self) -> HeadContext:
        """A sequence nobody holds, of a context with room (a new context when all are)."""
        with self._lock:
            room = next((sh for sh in self._shared if sh.free), None)
            if room is None:
                room = _Shared(self._lib, self.model, self.hidden)
                self._shared.append(room)
            return HeadContext(room, room.free.pop(), self.hidden, self.vocab)

    def release(self, ctx: HeadContext) -> None:
        ctx.remove_from(0)
        with self._lock:
            ctx._shared.free.append(ctx.seq)


def _free(lib: Any, model: Any, shared: list[_Shared]) -> None:
    for sh in shared:
        sh.close()
    lib.llama_free_model(model)


# each loaded while something drafts with it (a drafter holds its head's `GgmlHead`)
_MODELS: weakref.WeakValueDictionary[str, GgmlHead] = weakref.WeakValueDictionary()
_MODELS_LOCK = threading.Lock()


def head_model(digest: str, target: str, cfg: Any, state: dict[str, torch.Tensor],
               rows: torch.Tensor, keep: bool = True) -> GgmlHead:
    """The GGUF of the head whose file hashes to `digest`, loaded once per process: exported
    once and cached on disk (`keep`), or, for a head made in this process (online learning
    publishes one every few requests), exported, loaded and deleted (the model is read)."""
    path = gguf_file(digest, target)
    with _MODELS_LOCK:
        found = _MODELS.get(str(path))
        if found is None:
            if not path.is_file():
                export(cfg, state, rows, path)
            try:
                found = _MODELS[str(path)] = GgmlHead(path, int(cfg.hidden))
            finally:
                if not keep:
                    path.unlink(missing_ok=True)
        return found
