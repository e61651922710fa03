"""The draft head's drafter with its layer in ik_llama.cpp (`head:weights=ggml`).

Why: in torch a head step waits on its weights (int8 rows, bf16 activations: 2.2-2.9 ms a
step on a 2-vCPU AMD EPYC, a tenth of the target's call); ik_llama.cpp's Q8_0 kernels run the
same layer and output head in 0.6 ms cache-warm (`experiments/head_ggml.py`). `fc` over
(feature, token embedding) stays in torch (it reads the target's embedding table, int8 rows);
its output is the row the one-block model (`backends/ik/head_graph.py`) is fed. Exactness does
not depend on it: q is this head's own distribution over its kept tokens, whatever the
rounding of its weights.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from adaspec.backends.ik.head_graph import GgmlHead, head_model
from adaspec.core.sampling import SamplingParams
from adaspec.draft.head import HeadChain, HeadDrafter
from adaspec.draft.head_model import DraftHead, TokenHead
from adaspec.errors import InputError


class GgmlHeadDrafter(HeadDrafter):
    """`HeadDrafter` with its layer and output head in ik_llama.cpp: the cache is the
    context's (positions at and past the inputs fed are removed before the next feed, so a
    chain's drafted positions never outlive it); `fc` runs in torch (int8 rows)."""

    fuses = False

    def __init__(self, head: DraftHead, tokens: TokenHead, embed: torch.Tensor,
                 runner: GgmlHead) -> None:
        super().__init__(head, tokens, embed)
        self._run_on(runner)
        self._last_logits = torch.empty(0)  # the newest fed position's kept-token logits

    def _run_on(self, runner: GgmlHead) -> None:
        self.runner = runner
        self.cache = runner.acquire()  # this request's KV cache of the head, given back at GC
        self._release = weakref.finalize(self, runner.release, self.cache)

    def use(self, head: DraftHead, tokens: TokenHead) -> None:
        """`HeadDrafter.use`, on the model `head` was attached to (`attach`: online learning
        attaches each head it publishes; the shipped one is its file's)."""
        if head is self.head and tokens is self.tokens:
            return
        with _LOCK:
            runner = _RUNNERS.get(head)
        if runner is None:
            raise InputError("a draft head runs in ik_llama.cpp once attached (head_ggml.attach)")
        super().use(head, tokens)
        if runner is not self.runner:
            self._release()  # the other model's cache goes back now
            self._run_on(runner)

    def rows(self, features: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """fc's outputs [T, H] for features [T, H] and the tokens after them."""
        with torch.no_grad():
            return self.head.fc(torch.cat([features.to(self._dtype),
                                           self._embeds(ids)[0]], -1))

    def _sync(self, context: list[int]) -> None:
        super()._sync(context)
        self.cache.remove_from(self._fed)  # and whatever a chain drafted past it

    def _feed(self, feats: torch.Tensor, ids: list[int], positions: list[int]
              ) -> torch.Tensor | None:
        out = self.cache.decode(self.rows(feats, ids), positions)
        if out is None:  # the head's cache is full: it drafts no more
            return None
        self._last_logits = out[1]
        return out[0]

    def _chain(self, hidden: torch.Tensor, position: int) -> HeadChain:
        return GgmlChain(self, hidden, self._last_logits, position)

    def probe_step(self, context: int) -> Callable[[], None]:
        """One draft step over `context` cached positions (zeros), as a callable to time."""
        ctx = self.runner.acquire()
        zeros = torch.zeros(context, self.head.cfg.hidden)
        ctx.decode(zeros, list(range(context)))
        row = zeros[:1]

        def step() -> None:
            out = ctx.decode(self.rows(row, [0]), [context])
            ctx.remove_from(context)
            if out is not None:
                GgmlChain(self, *out, context + 1).draw(SamplingParams(0.0), None)

        weakref.finalize(step, self.runner.release, ctx)
        return step


class GgmlChain(HeadChain):
    """`HeadChain` over the drafter's context: each drafted token fed at the next position."""

    def __init__(self, drafter: GgmlHeadDrafter, hidden: torch.Tensor, small: torch.Tensor,
                 position: int) -> None:
        super().__init__(drafter, hidden, None, position)
        self._ggml = drafter
        self._small = small

    def small_logits(self) -> torch.Tensor:
        return self._small

    def advance(self, token: int) -> None:
        d = self._ggml
        out = d.cache.decode(d.rows(self._hidden[0], [token]), [self._position])
        if out is not None:  # else the head's cache is full: the chain repeats its last
            self._hidden, self._small = out  # distribution (what it drafts is verified)
        self._position += 1
        self.steps += 1


# the model each served head runs on: the loaded artifact's, and each one online learning
# published since (`attach`)
_RUNNERS: weakref.WeakKeyDictionary[DraftHead, GgmlHead] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def attach(head: DraftHead, rows: torch.Tensor, target: str, digest: str | None = None
           ) -> GgmlHead:
    """The model `head` (in `serving_head(..., "ggml")`'s form) drafts with: its layer and
    the output rows [N, H] exported and loaded once per process: cached on disk under
    `digest` (a head file's), or, with none (a head online learning made), named by a hash
    of its weights and rows and not kept on disk."""
    with _LOCK:
        found = _RUNNERS.get(head)
    if found is not None:
        return found
    state = {k: v for k, v in head.state_dict().items()
             if k.startswith("layer.") or k == "norm.weight"}
    keep = digest is not None  # a file's head: its export cached on disk
    if digest is None:
        hashed = hashlib.sha256()
        for name in sorted(state):
            hashed.update(name.encode())
            hashed.update(state[name].float().numpy().tobytes())
        hashed.update(rows.float().numpy().tobytes())  # a grown kept set: other rows
        digest = hashed.hexdigest()[:12]
    runner = head_model(digest, target, head.cfg, state, rows, keep)
    with _LOCK:
        return _RUNNERS.setdefault(head, runner)


def drafter(file: Path, target: str, head: DraftHead, tokens: TokenHead, embed: torch.Tensor
            ) -> GgmlHeadDrafter:
    """The drafter over shared parts (`HeadDrafter.shared_parts`), its model the one the
    head was attached to (the file's, first)."""
    from adaspec.draft.head_artifact import fingerprint

    digest = fingerprint(file).split(":")[-1]  # hashed once per file version
    runner = attach(head, tokens.proj.weight.detach(), target, digest)
    return GgmlHeadDrafter(head, tokens, embed, runner)


def default_weights(target: Any) -> str:
    """ggml where the target runs in ik_llama.cpp (its library is loaded for it, and runs a
    head step in half of int8 torch's time: experiments/results/head-ggml-epyc-avx512),
    int8 elsewhere (torch targets, a GPU's included)."""
    return "ggml" if str(getattr(target, "kind", "")).startswith("ik_llama") else "int8"


def load_drafter(path, target, weights: str = "default") -> HeadDrafter:
    """The drafter of a saved head in `weights` (`draft.head.WEIGHTS`, or `default`): ggml
    here, the torch formats by `HeadDrafter.load`."""
    if weights == "default":
        weights = default_weights(target)
    if weights != "ggml":
        return HeadDrafter.load(path, target, weights)
    file, parts = HeadDrafter.shared_parts(path, target, weights)
    made = drafter(file, target.name, *parts)
    made.origin = (file, weights)
    return made
