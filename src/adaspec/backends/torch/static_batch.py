"""Several sequences in the static runtime (issue 33): requests decoded together share one
call of the model. Keys and values live in one preallocated cache per layer [S, kv_heads,
max_context, head_dim], a row per sequence. A call pads every sequence's feed to the longest
and runs the projections and the MLP over all rows in one matrix product, so the weights,
what a decode step reads, are read once for the whole batch; attention runs per row over
that sequence's own cached length. A rollback moves a sequence's length (its view's), so
removal frees nothing; a shared prompt prefix is copied between rows.

Decode rounds (every feed at most 16 tokens) run at fixed shapes where the base runtime does
(`graphs`, a GPU's default): the cache's first rows take part, as many as the highest
sequence fed needs rounded up to a power of two, each padded to 1, 2, 4, 8 or 16 tokens (a
row without a feed is all padding), the padding written to scratch slots past
the cache, attention over the first `span` slots of every row (a power of two covering the
longest sequence). On a GPU each (rows, tokens, span) shape is captured once as a CUDA
graph and replayed; on the CPU the same pass runs eagerly (tests). Prompt chunks run at
their own shape.

A `SequenceOwner` (backends/sequences.py): the batch engine drives its views exactly as it
drives ik_llama.cpp's sequences. `StaticTorchBackend.sequences(n)` makes one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from adaspec.backends.sequences import ALL, LAST, Feed
from adaspec.backends.torch.decoder import Row, rope
from adaspec.backends.torch.graphs import PassInputs, capture_graph
from adaspec.errors import InputError

if TYPE_CHECKING:
    from adaspec.backends.torch.static import StaticTorchBackend

ROW_TOKENS = (1, 2, 4, 8, 16)  # tokens per row of a fixed pass (a feed's, padding included)
MIN_SPAN = 256  # the shortest attention span of a fixed pass (slots per row)


class StaticSequences:
    """`max_sequences` rows of cache over a static runtime's weights (sequence 0 is the
    owner's own, as in `sequences.views`)."""

    runtime = "the static torch runtime"
    has_hidden_states = True  # a sequence's final state (`final_state`, the router's input)
    has_features = True  # each call's final-normed output rows (`record_features`)

    def __init__(self, base: StaticTorchBackend, max_sequences: int) -> None:
        self.model, self.config = base.model, base.config
        self.max_context, self.dtype = base.max_context, base.dtype
        # what a view copies from its owner (`sequences._SHARED`)
        for attr in ("name", "vocab_size", "num_layers", "hidden_size", "bytes_per_forward",
                     "kind", "device"):
            setattr(self, attr, getattr(base, attr))
        self.max_sequences = int(max_sequences)
        self._inv_freq = base._inv_freq
        self.graphs = base.graphs  # cuda | eager | off, as the base runtime's
        cfg, weight = base.config, base.model.model.embed_tokens.weight
        pad = ROW_TOKENS[-1] if self.graphs != "off" else 0  # scratch slots past the cache
        shape = (self.max_sequences, cfg.num_kv_heads, self.max_context + pad, cfg.head_dim)
        self._cache = [(torch.zeros(shape, dtype=weight.dtype, device=weight.device),
                        torch.zeros(shape, dtype=weight.dtype, device=weight.device))
                       for _ in range(cfg.num_layers)]
        self._slot_ids = torch.arange(shape[2], device=weight.device)
        # by (rows, size, span, features)
        self._fixed: dict[tuple[int, int, int, bool], _BatchPass] = {}
        self._pool: Any = None
        self.calls = 0  # runtime calls made (each scores every feed given to it)
        self._features = False
        # the final-normed states of the last `feed_many`'s output rows, per feed, while
        # `record_features(True)`; else None
        self.last_features: list[torch.Tensor] | None = None

    def record_features(self, on: bool) -> None:
        """Return each call's output rows' final-normed states (`last_features`), for every
        sequence: they share the calls."""
        self._features = bool(on)
        self.last_features = None

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
        n = max(len(f.ids) for f in feeds)
        self.calls += 1
        wanted = _wanted(feeds)
        sizes = [len(w) for w in wanted]
        if self.graphs != "off" and n <= ROW_TOKENS[-1]:
            logits, picked = self._fixed_feed(feeds, n, wanted)
        else:
            x = self._rows_pass(feeds, n)
            picked = (torch.cat([x[r, w] for r, w in enumerate(wanted)]) if any(wanted)
                      else x[0, :0])
            logits = self.model.lm_head(picked)
        self.last_features = (list(picked.float().cpu().split(sizes)) if self._features
                              else None)
        return list(logits.float().cpu().split(sizes))

    @torch.inference_mode()
    def final_state(self, seq: int, start: int, token: int) -> torch.Tensor:
        """The final-layer state [1, hidden] of `token`, sequence `seq`'s last cached token
        at position `start` (fed again: its cache entry is written with what it held)."""
        x = self._rows_pass([Feed(seq, start, [token], LAST)], 1)
        return x[0, -1:].float().cpu()

    def _rows_pass(self, feeds: list[Feed], n: int) -> torch.Tensor:
        """The feeds padded to n tokens, each sequence's own length: the final normed
        states [feeds, n, hidden]."""
        cfg, model, dev = self.config, self.model, self._cache[0][0].device
        b = len(feeds)
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
        x = model.model.embed_tokens(ids.to(dev))
        layer: Any
        for i, layer in enumerate(model.model.layers):
            x = layer.step_rows(x, cos, sin, self._cache[i], rows)
        return model.model.norm(x)

    def _fixed_feed(self, feeds: list[Feed], n: int, wanted: list[list[int]]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row in one fixed-shape pass (replayed as a graph on a GPU); the feeds'
        wanted rows picked from it: logits [rows, V], and their final-normed states [rows,
        hidden] while recorded (else an empty tensor)."""
        size = next(t for t in ROW_TOKENS if t >= n)
        longest = max(f.start + len(f.ids) for f in feeds)
        span = MIN_SPAN
        while span < longest:
            span *= 2
        span = min(span, self.max_context)
        rows = self.row_bucket(max(f.seq for f in feeds) + 1)
        key = (rows, size, span, self._features)
        p = self._fixed.get(key)
        if p is None:
            p = self._fixed[key] = _BatchPass(
                rows, size, span, self.max_context, self._slot_ids.device, self._features)
            if self.graphs == "cuda":
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                p.graph, p.out = capture_graph(lambda: self._batch_pass(p), self._pool)
        p.load(feeds)
        if p.graph is not None:
            p.graph.replay()
            out = p.out
        else:
            out = self._batch_pass(p)
        index = torch.tensor([f.seq * size + t for f, w in zip(feeds, wanted, strict=True)
                              for t in w], dtype=torch.long, device=out.device)
        rows_out = out.index_select(0, index)
        vocab = self.config.vocab_size
        return rows_out[:, :vocab], rows_out[:, vocab:]

    def row_bucket(self, rows: int) -> int:
        """The rows a fixed pass runs for sequences 0 .. rows - 1: a power of two (or every
        row), so a few requests in a large cache pay for their own rows, not all of them,
        and the shapes (graphs) stay few."""
        bucket = 1
        while bucket < rows:
            bucket *= 2
        return min(bucket, self.max_sequences)

    def _batch_pass(self, p: _BatchPass) -> torch.Tensor:
        """Logits [rows x size, V] of a fixed pass over the first `p.rows` rows of the
        cache, the final-normed states after them [rows x size, V + hidden] where
        `p.features`: shapes depend on the rows, size and span alone; lengths, slots and
        tokens are read from `p`'s tensors."""
        cfg, model = self.config, self.model
        rows, size, span = p.rows, p.size, p.span
        at = self._slot_ids[:span][None, None, :]  # [1, 1, span] slot index
        i = self._slot_ids[:size][None, :, None]  # [1, size, 1] token index in its row
        start, real = p.starts[:, None, None], p.real[:, None, None]
        mask = ((at < start) | ((at >= start) & (at <= start + i) & (i < real))
                | ((at == 0) & (i >= real)))  # padding sees slot 0: never a bare row
        cos, sin = rope(p.positions.reshape(-1), cfg.head_dim, cfg.rope_theta, self.dtype,
                        self._inv_freq)
        cos, sin = cos.view(rows, size, -1), sin.view(rows, size, -1)
        stack = model.model
        x = stack.embed_tokens(p.ids)
        layer: Any
        for k, layer in enumerate(stack.layers):
            keys, values = self._cache[k]
            x = layer.step(x, cos, sin, (keys[:rows], values[:rows]), 0, mask[:, None],
                           slots=p.slots)
        normed = stack.norm(x).view(rows * size, -1)
        logits = model.lm_head(normed)
        return torch.cat([logits, normed], -1) if p.features else logits

    def remove_seq(self, seq: int, start: int) -> None:
        """Nothing to free: a sequence's length is its view's, and a pass reads only up to
        it (entries past it are overwritten when the sequence grows again)."""

    def copy_seq(self, src: int, dst: int, length: int) -> None:
        """Row `dst` holds row `src`'s first `length` positions (a shared prompt prefix)."""
        for keys, values in self._cache:
            keys[dst, :, :length] = keys[src, :, :length]
            values[dst, :, :length] = values[src, :, :length]


def _wanted(feeds: list[Feed]) -> list[list[int]]:
    """Per feed, which of its tokens' rows come back (`sequences.Feed.rows`)."""
    return [list(range(len(f.ids))) if f.rows == ALL else
            [len(f.ids) - 1] if f.rows == LAST else [] for f in feeds]


class _BatchPass:
    """The device buffers of one fixed batched pass (`rows` x `size` tokens, attention over
    `span` slots per row): token ids, rotary positions and cache slots [rows, size], each
    row's cached length and real tokens [rows]. A row without a feed, and a feed's padding,
    is token 0 at position 0 written to scratch slots; a captured graph reads the buffers at
    each replay. `features`: the pass returns the final-normed states beside the logits."""

    def __init__(self, rows: int, size: int, span: int, scratch: int,
                 device: torch.device, features: bool = False) -> None:
        self.rows, self.size, self.span = rows, size, span
        self.features = features
        self.inputs = PassInputs({"ids": (rows, size), "positions": (rows, size),
                                  "slots": (rows, size), "starts": (rows,),
                                  "real": (rows,)}, device)
        dev = self.inputs.dev
        self.ids, self.positions, self.slots, self.starts, self.real = (
            dev["ids"], dev["positions"], dev["slots"], dev["starts"], dev["real"])
        self._scratch = torch.arange(scratch, scratch + size)
        self.graph: Any = None
        self.out: Any = None
        self.load([])

    def load(self, feeds: list[Feed]) -> None:
        host = self.inputs.host
        self.inputs.clear()
        ids, positions, slots = host["ids"], host["positions"], host["slots"]
        starts, real = host["starts"], host["real"]
        slots[:] = self._scratch
        for f in feeds:
            m = len(f.ids)
            ids[f.seq, :m] = torch.tensor(f.ids)
            positions[f.seq, :m] = torch.arange(f.start, f.start + m)
            slots[f.seq, :m] = torch.arange(f.start, f.start + m)
            starts[f.seq], real[f.seq] = f.start, m
        self.inputs.send()
