"""Draft-model drafter: a small LM with its own KV cache proposes tokens autoregressively."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from adaspec.backends.base import ModelBackend, common_prefix
from adaspec.control.base import LengthController
from adaspec.core.proposal import Proposal
from adaspec.core.request import RequestState
from adaspec.core.sampling import SamplingParams, draw
from adaspec.draft.base import Drafter

if TYPE_CHECKING:
    from adaspec.draft.sorted_model import ExitState


def roll_back_to_common_prefix(
    backend: ModelBackend | ExitState, cached: list[int], context: list[int]
) -> None:
    """Truncate a draft cache (a backend's, or a sorted draft's per-segment state) and its
    token list, in place, to the longest common prefix with `context`: what stays is still
    valid, only the rest is recomputed."""
    n = 0
    limit = min(len(cached), len(context))
    while n < limit and cached[n] == context[n]:
        n += 1
    if n < len(cached):
        backend.truncate(n)
        del cached[n:]


def prefill_prompt(backend: ModelBackend, prompt_ids: list[int]) -> list[int]:
    """Start a request: score the prompt but its last token into an empty draft cache, so
    the draft's prompt prefill is timed on its own and the first draft step feeds two tokens
    (the last prompt token and the target's first). A backend that knows what its cache
    holds keeps the prefix this prompt shares with it (the chat template's system turn of
    the previous request) instead of scoring it again. The tokens now cached."""
    head = list(prompt_ids[:-1])
    if head:
        backend.prefill(torch.tensor(head), reuse=len(head))
    else:
        backend.reset()
    return head


def feed(backend: ModelBackend, tokens: list[int] | torch.Tensor) -> torch.Tensor:
    """Score tokens (host ids, or ids the draft drew on the device) after the draft cache;
    into an empty cache that is a prompt prefill (which a backend may run on a faster path
    for many rows). The logits where the draft ran (a GPU's memory): drafting reads back
    the ids and the few numbers it decides by."""
    ids = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(tokens)
    out = backend.prefill(ids) if backend.cache_len == 0 else backend.forward(ids)
    return out.device_logits


class ModelDrafter(Drafter):
    """Keeps the draft cache in step with the accepted context; only new tokens are fed."""

    name = "draft"
    # a chain no length rule can stop is drafted on the device, each token fed back there
    # and the chain's ids read once (False: each step reads its token, e.g. S2D's exits)
    chains_on_device = True

    def __init__(self, backend: ModelBackend) -> None:
        self.backend = backend
        self._cached: list[int] = []  # tokens whose keys/values are in the draft cache

    def begin(self, req: RequestState) -> None:
        self.prefill(req.prompt_ids)

    def prefill(self, context: list[int]) -> None:
        """Bring the draft cache to `context` (all but its last token, fed with the first
        draft), keeping what it already holds of it."""
        self._cached = prefill_prompt(self.backend, context)

    def _sync(self, context: list[int]) -> None:
        roll_back_to_common_prefix(self.backend, self._cached, context)

    @property
    def cached_len(self) -> int:
        """Tokens of the accepted context the draft cache holds."""
        return len(self._cached)

    def reusable(self, prompt_ids: list[int]) -> int:
        """Before `start`: about how many leading tokens of `prompt_ids` the draft cache
        still holds from this drafter's last request (what its prompt prefill can keep; a
        backend shared with other drafters may hold less, and keeps only what it holds)."""
        return common_prefix(self._cached, prompt_ids[:-1])

    def pending(self, context: list[int]) -> list[int]:
        """Roll the cache back to what `context` still agrees with; the tokens to feed before
        the first draft (at least the last one: its logits give the first draft)."""
        self._sync(context)
        if len(self._cached) == len(context):
            self.backend.truncate(len(context) - 1)
            del self._cached[-1:]
        return context[len(self._cached) :]

    def step(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` after the cache; the next token's raw logits [V], where the draft
        ran."""
        logits = feed(self.backend, tokens)[-1]
        self._cached.extend(tokens)
        return logits

    def propose(self, req: RequestState, max_tokens: int,
                controller: LengthController) -> Proposal:
        context, params, generator = req.context, req.sampling, req.generator
        pending = self.pending(context)
        if self.chains_on_device and not controller.stops_early:
            return self._chain(context[-1], pending, max_tokens, params, generator)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        calls = 0
        # the rows stay where the draft ran: on a GPU each drafted token brings back its id
        # and the few numbers the length rule decides by, in one read
        for i in range(max_tokens):
            logits = self.step(pending)
            calls += 1
            drawn, probs = draw(logits, params, generator)
            if probs is not None:
                rows.append(probs)
            read = torch.cat([drawn.double(), controller.draft_numbers(logits).double()]).tolist()
            token = int(read[0])
            tokens.append(token)
            pending = [token]
            if not controller.decide(i, read[1:]):
                break
        return Proposal.chain(
            context[-1], tokens, torch.stack(rows) if rows else None, forward_calls=calls
        )

    def _chain(self, root: int, pending: list[int], length: int, params: SamplingParams,
               generator: torch.Generator | None) -> Proposal:
        """`length` tokens, each drawn where the draft ran and fed back from there: on a GPU
        the chain's one read is its ids at the end (gpt-fast's draft loop). The same draws
        as the token-by-token loop: the argmax, or one uniform per token."""
        drawn: list[torch.Tensor] = []  # [1] each, where the draft ran
        rows: list[torch.Tensor] = []
        fed: list[int] | torch.Tensor = pending
        for _ in range(length):
            token, probs = draw(feed(self.backend, fed)[-1], params, generator)
            if probs is not None:
                rows.append(probs)
            drawn.append(token)
            fed = token
        tokens = torch.cat(drawn).tolist() if drawn else []  # the chain's one read
        self._cached.extend(pending + tokens[:-1])
        return Proposal.chain(
            root, tokens, torch.stack(rows) if rows else None, forward_calls=length
        )

    def commit(self, req: RequestState, path: list[int]) -> None:
        self._sync(req.context)
