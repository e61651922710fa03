"""Several sequences in one model: how a server scores every active request's next token (or
draft) in one runtime call.

A multi-sequence runtime (ik_llama.cpp: one KV cache whose entries carry a sequence id) is an
*owner*: it feeds `Feed`s of several sequences in one call and removes one sequence's tail.
Each request decodes on a `SequenceView`, a chain backend of its own (its cache length, its
prompt for prefix reuse), so the engine runs on it unchanged; `forward_together` scores the
next inputs of many views in one call of their owner. A runtime without sequences (torch)
gives independent backends over the shared weights instead: `forward_together` then runs
them one after the other (correct, not faster).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from adaspec.backends.base import (
    ChainBackend,
    ForwardOutput,
    ModelBackend,
    common_prefix,
    reusable_prefix,
)
from adaspec.errors import InputError

# Which rows of a feed come back: every fed token's (verification), the last one's (the end
# of a prompt), none (a prompt chunk that is not the last).
ALL, LAST, NONE = "all", "last", "none"

# the fewest prompt tokens worth taking from a sibling's cache (a batch may hold a prompt
# back a round for it: engine/batch.py)
MIN_SHARE = 16

# the attributes a view copies from its owner (what engines, profiles and routers read)
_SHARED = ("name", "vocab_size", "num_layers", "hidden_size", "bytes_per_forward", "kind",
           "batch_noise", "n_params", "model",  # model: a torch owner's (online distillation)
           "pooled_cache", "has_features", "supports_trees", "tree_block", "tree_span")


@dataclass
class Feed:
    seq: int  # the runtime's sequence id
    start: int  # position of ids[0]: the sequence's cache length
    ids: list[int]
    rows: str = ALL  # ALL | LAST | NONE
    # each token's position where they are not start, start + 1, ... (a token tree's: its
    # root's plus each node's depth)
    positions: list[int] | None = None


class SequenceOwner(Protocol):
    """A runtime that holds several sequences in one KV cache."""

    max_context: int
    max_sequences: int  # sequence ids 0 .. max_sequences - 1; 0 is the owner's own

    def feed_many(self, feeds: list[Feed]) -> list[torch.Tensor]:
        """Score every feed after its sequence's cache in one call (split only where the
        batch is full); per feed its rows: [n, V] (ALL), [1, V] (LAST), [0, V] (NONE)."""
        ...

    def remove_seq(self, seq: int, start: int) -> None:
        """Drop sequence `seq`'s cached positions from `start` on."""
        ...


class SharingOwner(SequenceOwner, Protocol):
    """An owner whose sequences can share cache entries (a common prompt prefix)."""

    def copy_seq(self, src: int, dst: int, length: int) -> None:
        """Sequence `dst` holds `src`'s first `length` positions and nothing else."""
        ...


class TreeOwner(SequenceOwner, Protocol):
    """An owner that scores a token tree of one sequence in one call (`supports_trees`)."""

    def feed_tree(self, seq: int, ids: list[int], positions: list[int], parents: list[int]
                  ) -> torch.Tensor:
        """Every node's logits [n, V]; ids[0] the root right after the sequence's cache."""
        ...

    def keep_tree(self, seq: int, root: int, n: int, path: list[int]) -> None:
        """Keep nodes `path` of the last tree where a chain puts them; free the others."""
        ...


class StateOwner(SequenceOwner, Protocol):
    """An owner that reads a sequence's final-layer state (the router's input)."""

    def final_state(self, seq: int, start: int, token: int) -> torch.Tensor:
        """[1, hidden]: `token`, sequence `seq`'s last cached token at `start`, its cache
        entry as it was."""
        ...


class SequenceView(ChainBackend):
    """One sequence of a multi-sequence runtime, as a backend of its own."""

    def __init__(self, owner: SequenceOwner, seq: int, max_context: int) -> None:
        for attr in _SHARED:
            if hasattr(owner, attr):
                setattr(self, attr, getattr(owner, attr))
        self.runtime = getattr(owner, "runtime", "this runtime")
        # a prompt's final state (the router's input), where the owner reads one per sequence
        self.has_hidden_states = bool(getattr(owner, "has_hidden_states", False)
                                      and hasattr(owner, "final_state"))
        self.owner = owner
        self.seq = seq
        self.max_context = max_context
        self._len = 0
        self.siblings: Sequence[SequenceView] = ()  # the owner's other views (`views`)
        self.shared_tokens = 0  # prompt tokens taken from a sibling's cache, not computed
        # the owner's sequences share its max_context cells (ik_llama.cpp), or each has as
        # many of its own (the static runtime's rows)
        self.pooled_cache = bool(getattr(owner, "pooled_cache", False))

    def _feed(self, ids: list[int], every_row: bool) -> torch.Tensor:
        out = self.owner.feed_many([Feed(self.seq, self._len, ids, ALL if every_row else LAST)])
        self._len += len(ids)
        return out[0]

    def begin_feed(self, n: int) -> int:
        """Before `n` tokens of this sequence go into a call of several (`forward_together`):
        the position they start at, or an InputError where they do not fit."""
        if self._len + n > self.max_context:
            raise InputError(f"context too long for {self.runtime}: {self._len + n} > "
                             f"{self.max_context} tokens")
        del self._token_ids()[self._len :]
        return self._len

    def fed(self, ids: list[int]) -> None:
        """After a call of several scored `ids` for this sequence: they are cached."""
        self._len += len(ids)
        self._token_ids().extend(ids)

    def lost(self) -> None:
        """After a call of several failed: what the runtime kept is unknown, so nothing is
        taken as held."""
        del self._token_ids()[:]

    def _remove_from(self, length: int) -> None:
        self.owner.remove_seq(self.seq, length)

    def _feed_tree(self, ids: list[int], positions: list[int], parents: list[int]
                   ) -> torch.Tensor:
        owner: TreeOwner = self.owner  # type: ignore[assignment]  # supports_trees
        return owner.feed_tree(self.seq, ids, positions, parents)

    def _keep_tree(self, root: int, n: int, path: list[int]) -> None:
        owner: TreeOwner = self.owner  # type: ignore[assignment]  # supports_trees
        owner.keep_tree(self.seq, root, n, path)

    def _fed_features(self) -> torch.Tensor | None:
        feats = getattr(self.owner, "last_features", None)
        return feats[0] if feats else None

    def record_features(self, on: bool) -> None:
        """The owner's runtime records every call's final-normed states (all its
        sequences': they share its calls)."""
        record = getattr(self.owner, "record_features", None)
        if record is None:
            raise InputError(f"{self.runtime} gives no target features")
        record(on)

    def _final_state(self) -> torch.Tensor:
        ids = self._token_ids()
        if not ids or self._len != len(ids):
            raise InputError("no prompt in the cache to read a hidden state from")
        owner: StateOwner = self.owner  # type: ignore[assignment]  # has_hidden_states
        return owner.final_state(self.seq, self._len - 1, ids[-1])

    def plan_prefill(self, ids: list[int], reuse: int) -> list[int]:
        """The start of a prefill fed in chunks (`forward_together` with LAST / NONE rows):
        keep what the cache holds of the prompt (`_keep_prefix`) and return the tokens
        still to feed."""
        if not ids:
            raise InputError("empty prompt")
        return ids[self._keep_prefix(ids, reuse):]

    def available_prefix(self, ids: list[int], reuse: int) -> int:
        """How many leading tokens of prompt `ids` a prefill would not compute: kept in
        this sequence or taken from a sibling, up to `reuse` either way."""
        own = reusable_prefix(self.held(), ids, reuse)
        return max(own, min(self.shareable(ids), reuse))

    def shareable(self, ids: list[int]) -> int:
        """How many leading tokens of prompt `ids` a sibling's cache holds (at least one
        token left to score)."""
        if not hasattr(self.owner, "copy_seq"):
            return 0
        held = [common_prefix(v.held(), ids) for v in self.siblings if v is not self]
        return min(max(held, default=0), len(ids) - 1)

    def _keep_prefix(self, ids: list[int], reuse: int) -> int:
        """What this sequence keeps of the prompt, or a longer prefix a sibling holds (a
        shared system turn, a conversation's earlier turns): its cache entries are shared,
        not computed again (ik_llama.cpp tags them with both sequence ids), when that
        saves at least MIN_SHARE tokens."""
        kept = reusable_prefix(self._token_ids(), ids, reuse)
        best = min(self.shareable(ids), reuse)  # `reuse` bounds a sibling's share too
        if best - kept < MIN_SHARE:
            self.truncate(kept)
            return kept
        donor = next(v for v in self.siblings
                     if v is not self and common_prefix(v.held(), ids) >= best)
        owner: SharingOwner = self.owner  # type: ignore[assignment]
        cached = self._token_ids()
        del cached[:]  # if the copy fails, nothing is taken as held
        self._len = 0
        owner.copy_seq(donor.seq, self.seq, best)
        cached.extend(ids[:best])
        self._len = best
        self.shared_tokens += best - kept
        return best


def views(owner: SequenceOwner, n: int) -> list[SequenceView]:
    """Views of `owner`'s sequences 1 .. n (0 is its own), each knowing the others: a
    prompt may take its prefix from a sibling's cache."""
    out = [SequenceView(owner, seq, owner.max_context) for seq in range(1, n + 1)]
    for view in out:
        view.siblings = out
    return out


def forward_together(
    items: Sequence[tuple[ModelBackend, list[int], str]],
) -> list[torch.Tensor]:
    """Score each backend's tokens after its cache: (backend, ids, rows) -> rows as in
    `Feed`. Views of one owner go in one runtime call; any other backend is fed alone
    (ALL rows through `forward`; LAST / NONE are for views only)."""
    return [o.device_logits for o in score_together(items)]


def score_together(
    items: Sequence[tuple[ModelBackend, list[int], str]],
) -> list[ForwardOutput]:
    """`forward_together`, each item's rows as a ForwardOutput: their logits, and their
    final-normed states where the runtime records them (`record_features`)."""
    out: list[ForwardOutput | None] = [None] * len(items)
    groups: dict[int, list[int]] = {}
    for i, (backend, ids, rows) in enumerate(items):
        if isinstance(backend, SequenceView):
            groups.setdefault(id(backend.owner), []).append(i)
        elif rows != ALL:
            raise InputError("only a sequence of a multi-sequence runtime feeds prompt chunks")
        else:
            out[i] = backend.forward(torch.tensor(ids))
    for members in groups.values():
        views = [_view(items[i][0]) for i in members]
        if len({v.seq for v in views}) != len(views):
            raise RuntimeError("two feeds of one sequence in one call")
        starts = [view.begin_feed(len(items[i][1])) for i, view in zip(members, views,
                                                                         strict=True)]
        feeds = [Feed(v.seq, start, list(items[i][1]), items[i][2])
                 for i, v, start in zip(members, views, starts, strict=True)]
        try:
            scored = views[0].owner.feed_many(feeds)
        except BaseException:
            for view in views:
                view.lost()
            raise
        feats = getattr(views[0].owner, "last_features", None)
        for k, (i, view, got) in enumerate(zip(members, views, scored, strict=True)):
            view.fed(list(items[i][1]))
            out[i] = ForwardOutput(got, features=feats[k] if feats else None)
    return [o if o is not None else ForwardOutput(torch.empty(0)) for o in out]


def _view(backend: ModelBackend) -> SequenceView:
    assert isinstance(backend, SequenceView)
    return backend


def sequences(backend: ModelBackend, n: int) -> list[ModelBackend]:
    """`n` backends over `backend`'s weights, each with a cache of its own, for requests
    decoded together; InputError naming the fix where the runtime keeps one sequence."""
    make = getattr(backend, "sequences", None)
    if make is None:
        raise InputError(f"the {backend.kind} runtime keeps one sequence: decoding requests "
                         "together needs ik_llama.cpp (--weights ik) or torch weights")
    return list(make(n))
