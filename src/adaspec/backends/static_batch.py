"""Several sequences in the static runtime (issue 33): requests decoded together share one
call of the model. Keys and values live in one preallocated cache per layer [S, kv_heads,
max_context, head_dim], a row per sequence. A call pads every sequence's feed to the longest
and runs the projections and the MLP over all rows in one matrix product, so the weights,
what a decode step reads, are read once for the whole batch; attention runs per row over
that sequence's own cached length. A rollback moves a sequence's length (its view's), so
removal frees nothing; a shared prompt prefix is copied between rows.

A `SequenceOwner` (backends/sequences.py): the batch engine drives its views exactly as it
drives ik_llama.cpp's sequences. `StaticTorchBackend.sequences(n)` makes one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from adaspec.backends.decoder import Row, rope
from adaspec.backends.sequences import ALL, LAST, Feed
from adaspec.errors import InputError

if TYPE_CHECKING:
    from adaspec.backends.static_torch import StaticTorchBackend


class StaticSequences:
    """`max_sequences` rows of cache over a static runtime's weights (sequence 0 is the
    owner's own, as in `sequences.views`)."""

    runtime = "the static torch runtime"

    def __init__(self, base: StaticTorchBackend, max_sequences: int) -> None:
        self.model, self.config = base.model, base.config
        self.max_context, self.dtype = base.max_context, base.dtype
        # what a view copies from its owner (`sequences._SHARED`)
        for attr in ("name", "vocab_size", "num_layers", "hidden_size", "bytes_per_forward",
                     "kind", "device"):
            setattr(self, attr, getattr(base, attr))
        self.max_sequences = int(max_sequences)
        self._inv_freq = base._inv_freq
        cfg, weight = base.config, base.model.embed_tokens.weight
        shape = (self.max_sequences, cfg.num_kv_heads, self.max_context, cfg.head_dim)
        self._cache = [(torch.zeros(shape, dtype=weight.dtype, device=weight.device),
                        torch.zeros(shape, dtype=weight.dtype, device=weight.device))
                       for _ in range(cfg.num_layers)]
        self.calls = 0  # runtime calls made (each scores every feed given to it)

    @torch.inference_mode()
    def feed_many(self, feeds: list[Feed]) -> list[torch.Tensor]:
        """Score every feed after its sequence's cache in one pass; per feed its rows: [n, V]
        (ALL), [1, V] (LAST), [0, V] (NONE), on the CPU."""
        if not feeds:
            return []
        for f in feeds:
            if not 0 <= f.seq < self.max_sequences or not f.ids:
                raise InputError(f"sequence {f.seq}: no such sequence, or nothing to feed")
            if f.start + len(f.ids) > self.max_context:
                raise InputError(f"context too long for the static runtime: "
                                 f"{f.start + len(f.ids)} > {self.max_context} tokens")
        if len({f.seq for f in feeds}) != len(feeds):
            raise InputError("two feeds of one sequence in one call")
        cfg, model, dev = self.config, self.model, self._cache[0][0].device
        b, n = len(feeds), max(len(f.ids) for f in feeds)
        ids = torch.zeros(b, n, dtype=torch.long)
        pos = torch.zeros(b, n, dtype=torch.long)
        rows = []
        for r, f in enumerate(feeds):
            m = len(f.ids)
            ids[r, :m] = torch.tensor(f.ids)
            pos[r, :m] = torch.arange(f.start, f.start + m)
            mask = torch.ones(m, f.start + m, dtype=torch.bool).tril(f.start).to(dev)
            rows.append(Row(f.seq, f.start, m, mask))
        cos, sin = rope(pos.reshape(-1).to(dev), cfg.head_dim, cfg.rope_theta, self.dtype,
                        self._inv_freq)
        cos, sin = cos.view(b, n, -1), sin.view(b, n, -1)
        x = model.embed_tokens(ids.to(dev))
        layer: Any
        for i, layer in enumerate(model.layers):
            x = layer.step_rows(x, cos, sin, self._cache[i], rows)
        x = model.norm(x)
        wanted = [list(range(len(f.ids))) if f.rows == ALL else
                  [len(f.ids) - 1] if f.rows == LAST else [] for f in feeds]
        picked = torch.cat([x[r, w] for r, w in enumerate(wanted)]) if any(wanted) else x[0, :0]
        logits = model.lm_head(picked).float().cpu()
        self.calls += 1
        return list(logits.split([len(w) for w in wanted]))

    def remove_seq(self, seq: int, start: int) -> None:
        """Nothing to free: a sequence's length is its view's, and a pass reads only up to
        it (entries past it are overwritten when the sequence grows again)."""

    def copy_seq(self, src: int, dst: int, length: int) -> None:
        """Row `dst` holds row `src`'s first `length` positions (a shared prompt prefix)."""
        for keys, values in self._cache:
            keys[dst, :, :length] = keys[src, :, :length]
            values[dst, :, :length] = values[src, :, :length]
