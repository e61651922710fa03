"""A model backend served by a child process (`child_process`): how adaspec runs a llama.cpp
model beside a torch one, each runtime with its own threads.

Calls cross a socket as small messages; logits come back through a shared memory file
(memfd), so a verification's rows of 151,936 floats are one copy, not a pickled stream. The
pipe and the copy add about 1.5 ms to a 50 ms draft step.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from adaspec.backends.base import (
    ForwardOutput,
    Loaded,
    LoadRequest,
    ModelBackend,
    chain_ids,
    eos_ids_of,
    tree_parents,
)
from adaspec.backends.child_process import ChildProcess
from adaspec.backends.sequences import Feed, SequenceView, views
from adaspec.errors import InputError

# what the parent mirrors of the child's model; `patches` and `built_at` (a native build's
# source changes and build time) are in the cost profiles' key, so a library with new
# kernels gets its curves measured again
_ATTRIBUTES = ("name", "vocab_size", "max_context", "num_layers", "hidden_size",
               "bytes_per_forward", "kind", "batch_noise", "has_hidden_states", "n_params",
               "max_sequences", "patches", "built_at", "pooled_cache", "has_features",
               "supports_trees", "tree_block", "tree_span")


class _SharedRows:
    """Float32 rows in a memory file both processes map: the child writes (growing the file
    when a call returns more rows than fit), the parent reads (remapping after growth)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map: mmap.mmap | None = None

    def _mapped(self) -> mmap.mmap:
        size = os.fstat(self.fd).st_size
        if self._map is None or len(self._map) != size:
            if self._map is not None:
                self._map.close()
            self._map = mmap.mmap(self.fd, size)
        return self._map

    def write(self, rows: torch.Tensor) -> tuple[int, int]:
        array = rows.detach().to(torch.float32).contiguous().numpy()
        if array.nbytes > os.fstat(self.fd).st_size:
            os.ftruncate(self.fd, array.nbytes)
        view = np.frombuffer(self._mapped(), dtype=np.float32, count=array.size)
        view[:] = array.reshape(-1)
        return array.shape[0], array.shape[1]

    def read(self, rows: int, columns: int) -> torch.Tensor:
        view = np.frombuffer(self._mapped(), dtype=np.float32, count=rows * columns)
        return torch.from_numpy(view.reshape(rows, columns).copy())

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
        os.close(self.fd)


class _BackendServer:
    """Child side: the backend, answering with logits in the shared rows and its cache
    length."""

    def __init__(self, rows_fd: int, factory: Callable[..., ModelBackend], args: tuple) -> None:
        self.backend = factory(*args)
        self.rows = _SharedRows(rows_fd)

    def attributes(self) -> dict[str, Any]:
        return {a: getattr(self.backend, a) for a in _ATTRIBUTES if hasattr(self.backend, a)}

    def _write(self, out: ForwardOutput) -> tuple[int, int]:
        """The logits [n, V], then the features [n', H] where recorded, in the shared rows;
        (n, n')."""
        logits = out.logits
        if out.features is None:
            self.rows.write(logits)
            return int(logits.shape[0]), -1
        self.rows.write(torch.cat([logits.reshape(-1), out.features.reshape(-1)])[None])
        return int(logits.shape[0]), int(out.features.shape[0])

    def forward(self, ids: list[int]) -> tuple[tuple[int, int], int]:
        return self._write(self.backend.forward(torch.tensor(ids))), self.backend.cache_len

    def forward_tree(self, ids: list[int], positions: list[int], parents: list[int]
                     ) -> tuple[tuple[int, int], int]:
        run: Any = self.backend  # a runtime of trees (the parent checked `supports_trees`)
        return self._write(run.forward_tree(ids, positions, parents)), self.backend.cache_len

    def prefill(self, ids: list[int], reuse: int = 0, hidden_layer: int | None = None
                ) -> tuple[tuple[int, int], int, list[float] | None, int]:
        out = self.backend.prefill(torch.tensor(ids), hidden_layer=hidden_layer, reuse=reuse)
        rows = self._write(out)
        hidden = None if out.hidden is None else out.hidden.reshape(-1).tolist()
        return rows, self.backend.cache_len, hidden, out.cached

    def truncate(self, length: int) -> int:
        self.backend.truncate(length)
        return self.backend.cache_len

    def feed_many(self, feeds: list[tuple[int, int, list[int], str]]) -> list[int]:
        """Every feed's rows, one after the other in the shared rows (their features after
        all of them, where recorded: `record_features`); their counts."""
        run: Any = self.backend  # a multi-sequence runtime (the parent checked)
        out = run.feed_many([Feed(*f) for f in feeds])
        rows = [int(o.shape[0]) for o in out]
        feats = getattr(run, "last_features", None)
        if sum(rows):
            flat = [torch.cat([o for o in out if o.shape[0]]).reshape(-1)]
            if feats is not None:
                flat.append(torch.cat([f for f in feats if f.shape[0]]).reshape(-1))
            self.rows.write(torch.cat(flat)[None])
        return rows

    def record_features(self, on: bool) -> None:
        run: Any = self.backend
        run.record_features(on)

    def feed_tree(self, seq: int, ids: list[int], positions: list[int], parents: list[int]
                  ) -> tuple[int, int]:
        run: Any = self.backend
        logits = run.feed_tree(seq, ids, positions, parents)
        feats = getattr(run, "last_features", None)
        return self._write(ForwardOutput(logits, features=feats[0] if feats else None))

    def keep_tree(self, seq: int, root: int, n: int, path: list[int]) -> None:
        run: Any = self.backend
        run.keep_tree(seq, root, n, path)

    def remove_seq(self, seq: int, start: int) -> None:
        run: Any = self.backend
        run.remove_seq(seq, start)

    def copy_seq(self, src: int, dst: int, length: int) -> None:
        run: Any = self.backend
        run.copy_seq(src, dst, length)

    def final_state(self, seq: int, start: int, token: int) -> list[float]:
        run: Any = self.backend
        return run.final_state(seq, start, token).reshape(-1).tolist()

    def keep(self, indices: list[int]) -> int:
        self.backend.keep(torch.tensor(indices))
        return self.backend.cache_len


class ProcessBackend(ModelBackend):
    """`factory(*args)`'s backend, run in a child process; token trees where the child's
    backend scores them (`supports_trees`); the final layer's state of a prompt where the
    child's backend gives it."""

    supports_trees = False
    has_hidden_states = False  # until the child says

    def __init__(self, factory: Callable[..., ModelBackend], *args: Any,
                 wait: bool = True) -> None:
        """wait=False: return once the child is started; `ready()` waits for the model (so
        a target and a draft can load at the same time)."""
        self._rows = _SharedRows(os.memfd_create("adaspec-logits"))
        try:
            self._child = ChildProcess(
                _BackendServer, self._rows.fd, factory, args, pass_fds=(self._rows.fd,),
                wait=False,
            )
        except BaseException:
            self._rows.close()
            raise
        self._len = 0
        self._ready = False
        self._features = False
        self.has_features = False  # until the child says
        self.last_features: list[torch.Tensor] | None = None
        if wait:
            self.ready()

    def ready(self) -> ProcessBackend:
        if not self._ready:
            for key, value in self._child.call("attributes").items():
                setattr(self, key, value)
            self.kind = f"{self.kind}+child"
            self._ready = True
        return self

    @property
    def cache_len(self) -> int:
        return self._len

    def reset(self) -> None:
        self.truncate(0)

    def _read(self, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The child's logits [n, V] and features [n', H] (None: not recorded)."""
        n, m = rows
        if m < 0:
            return self._rows.read(n, self.vocab_size), None
        flat = self._rows.read(1, n * self.vocab_size + m * self.hidden_size)[0]
        return (flat[: n * self.vocab_size].view(n, self.vocab_size),
                flat[n * self.vocab_size :].view(m, self.hidden_size))

    def _logits(self, op: str, ids: list[int]) -> ForwardOutput:
        rows, self._len = self._child.call(op, ids)
        logits, features = self._read(rows)
        return ForwardOutput(logits=logits, features=features)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        hidden_layer: int | None = None,
    ) -> ForwardOutput:
        if tree_mask is not None and self.supports_trees and hidden_layer is None:
            ids = [int(t) for t in tokens.reshape(-1)]
            at = (list(range(self._len, self._len + len(ids))) if positions is None
                  else [int(p) for p in positions.reshape(-1)])
            rows, self._len = self._child.call("forward_tree", ids, at, tree_parents(tree_mask))
            logits, features = self._read(rows)
            return ForwardOutput(logits=logits, features=features)
        ids = chain_ids("a model in a child process", self._len, tokens, positions, tree_mask,
                        hidden_layer)
        return self._logits("forward", ids)

    def prefill(
        self, tokens: torch.Tensor, hidden_layer: int | None = None, reuse: int = 0
    ) -> ForwardOutput:
        if hidden_layer is not None and not self.has_hidden_states:
            raise InputError(f"this model's runtime ({self.kind}) gives no hidden states")
        ids = [int(t) for t in tokens.reshape(-1)]
        rows, self._len, hidden, cached = self._child.call("prefill", ids, int(reuse),
                                                           hidden_layer)
        state = None if hidden is None else torch.tensor(hidden).reshape(1, -1)
        logits, features = self._read(rows)
        return ForwardOutput(logits=logits, hidden=state, cached=cached, features=features)

    def truncate(self, length: int) -> None:
        if length < self._len:
            self._len = self._child.call("truncate", int(length))

    max_sequences = 1  # until the child says

    def sequences(self, n: int) -> list[SequenceView]:
        """Views of the child's sequences 1 .. n (its runtime holds several)."""
        if n >= self.max_sequences:
            raise InputError(f"this model's runtime ({self.kind}) was loaded for "
                             f"{self.max_sequences - 1} sequences besides its own, not {n}")
        return views(self, n)

    def feed_many(self, feeds: list[Feed]) -> list[torch.Tensor]:
        counts = self._child.call("feed_many", [(f.seq, f.start, f.ids, f.rows) for f in feeds])
        total = sum(counts)
        width = self.vocab_size + (self.hidden_size if self._features else 0)
        flat = self._rows.read(1, total * width)[0] if total else None
        rows = flat[: total * self.vocab_size].view(total, self.vocab_size) \
            if flat is not None else None
        feats = flat[total * self.vocab_size:].view(total, self.hidden_size) \
            if flat is not None and self._features else None
        out, states, at = [], [], 0
        for n in counts:
            out.append(rows[at : at + n] if rows is not None else torch.empty(0, self.vocab_size))
            if self._features:
                states.append(feats[at : at + n] if feats is not None
                              else torch.empty(0, self.hidden_size))
            at += n
        self.last_features = states if self._features else None
        return out

    def feed_tree(self, seq: int, ids: list[int], positions: list[int], parents: list[int]
                  ) -> torch.Tensor:
        """A token tree of sequence `seq` scored in one call of the child's runtime
        (`sequences.TreeOwner`); its features in `last_features` where recorded."""
        logits, features = self._read(self._child.call("feed_tree", seq, ids, positions,
                                                       parents))
        self.last_features = [features] if features is not None else None
        return logits

    def keep_tree(self, seq: int, root: int, n: int, path: list[int]) -> None:
        self._child.call("keep_tree", seq, root, n, path)

    def record_features(self, on: bool) -> None:
        """The child's backend returns the output rows' final-normed states beside their
        logits (`last_features` after each `feed_many`)."""
        self._child.call("record_features", bool(on))
        self._features = bool(on)
        self.last_features = None

    def remove_seq(self, seq: int, start: int) -> None:
        self._child.call("remove_seq", int(seq), int(start))

    def copy_seq(self, src: int, dst: int, length: int) -> None:
        self._child.call("copy_seq", int(src), int(dst), int(length))

    def final_state(self, seq: int, start: int, token: int) -> torch.Tensor:
        """Sequence `seq`'s last cached token's final-layer state [1, hidden] (the router's
        input), where the child's runtime gives one (`has_hidden_states`)."""
        if not self.has_hidden_states:
            raise InputError(f"the {self.kind} runtime has no hidden states")
        state = self._child.call("final_state", int(seq), int(start), int(token))
        return torch.tensor(state, dtype=torch.float32).view(1, -1)

    def keep(self, indices: torch.Tensor) -> None:
        self._len = self._child.call("keep", [int(i) for i in indices.reshape(-1)])

    def close(self) -> None:
        """Stop the child (also done when the backend is collected)."""
        self._child.close()
        if self._rows.fd >= 0:
            self._rows.close()
            self._rows.fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def start_in_child(backend_class: type, args: tuple[Any, ...], req: LoadRequest
                   ) -> Callable[[], Loaded]:
    """A llama.cpp-family runtime's model (`backend_class(*args)`) in a child process of its
    own, started now so several load at once: beside torch in one process the two thread
    pools slow each other down about 2x, and a native abort in the child is a one-line error.
    The tokenizer still comes from the verified cache; with `req.tokenizer_like` naming a
    model with the same tokenizer files it is not loaded twice (None comes back)."""
    from adaspec.store.loading import same_vocabulary_files, tokenizer_dir
    from adaspec.store.model_store import load_tokenizer

    backend = ProcessBackend(backend_class, *args, wait=False)

    def finish() -> Loaded:
        try:
            tokenizer = None
            if req.tokenizer_like is None or not same_vocabulary_files(
                tokenizer_dir(req.name, req.dtype), tokenizer_dir(req.tokenizer_like, req.dtype)
            ):
                tokenizer = load_tokenizer(req.name, req.dtype)
            backend.ready()
        except BaseException:
            backend.close()
            raise
        return backend, tokenizer, eos_ids_of(None, tokenizer) if tokenizer else []

    return finish
