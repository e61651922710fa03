"""The draft head's drafter: chains from a small module over the target's own features.

The head (`lab/head/model.py`) keeps a cache of its inputs at the accepted positions, each
built from the target's feature there (the final-normed state the verification pass
returned, `RequestState.features`) and the embedding of the token after it. A step first
feeds the positions accepted since the last one (in one call: the path the target accepted
and its own token), whose last output gives the first draft token; each further draft token
feeds the head's own output back as the feature. Drafted positions never enter the cache:
once verified, they come back with the target's features, so nothing is rolled back but a
cut to the common prefix when the context changes.

Where the runtime returned no feature for a position (a prompt scored for its last row only)
the head's cache simply lacks it: the positions stay absolute (rotary positions), and the
head drafts from what it has. Probabilities come over the full vocabulary with q = 0 outside
the kept tokens (`TokenHead.full_logits`), so speculative sampling stays exact.
"""

from __future__ import annotations

import torch

from adaspec.control.base import LengthController
from adaspec.core.proposal import Proposal
from adaspec.core.request import RequestState
from adaspec.core.sampling import draw
from adaspec.draft.base import Drafter
from adaspec.lab.head.model import DraftHead, TokenHead


class HeadDrafter(Drafter):
    name = "head"
    needs_features = True

    def __init__(self, head: DraftHead, tokens: TokenHead, embed: torch.Tensor) -> None:
        """embed [V, H]: the target's token embeddings (read a row at a time)."""
        self.head = head.eval()
        self.tokens = tokens
        self.embed = embed
        self._dtype = next(head.parameters()).dtype
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fed = 0  # inputs 0 .. _fed - 1 are in the cache (those with a feature)
        self._positions = torch.empty(0, dtype=torch.long)  # of the inputs in the cache
        self._cached: list[int] = []  # the context the cache was built on

    def begin(self, req: RequestState) -> None:
        self._kv, self._fed, self._cached = None, 0, []
        self._positions = torch.empty(0, dtype=torch.long)

    def _embeds(self, ids: list[int]) -> torch.Tensor:
        return self.embed[torch.tensor(ids)].to(self._dtype)[None]  # [1, n, H]

    def _sync(self, context: list[int]) -> None:
        """Keep the cache's inputs the context still agrees with (a cut to the common
        prefix: input i reads tokens i and i + 1)."""
        n = 0
        limit = min(len(self._cached), len(context))
        while n < limit and self._cached[n] == context[n]:
            n += 1
        keep = max(0, min(self._fed, n - 1))
        if keep < self._fed and self._kv is not None:
            k, v = self._kv
            kept = int((self._positions < keep).sum())
            self._kv = (k[:, :, :kept], v[:, :, :kept]) if kept else None
            self._positions = self._positions[:kept]
        self._fed = keep
        self._cached = list(context)

    def _catch_up(self, req: RequestState) -> torch.Tensor | None:
        """Feed the inputs of the positions accepted since the last step; the newest one's
        output [1, 1, H], or None when the target gave no feature of the newest position."""
        context = req.context
        self._sync(context)
        newest = len(context) - 2  # input i: (feature at i, token i + 1)
        first, feats = req.features_of(self._fed, newest + 1)
        if feats is None or first + len(feats) - 1 != newest:
            return None
        positions = torch.arange(first, newest + 1)
        with torch.no_grad():
            out, self._kv = self.head(feats.to(self._dtype)[None],
                                      self._embeds(context[first + 1 : newest + 2]),
                                      positions[None], self._kv)
        self._positions = torch.cat([self._positions, positions])
        self._fed = newest + 1
        return out[:, -1:]

    def propose(self, req: RequestState, max_tokens: int,
                controller: LengthController) -> Proposal:
        context = req.context
        hidden = self._catch_up(req)
        if hidden is None or max_tokens <= 0:
            return Proposal.chain(context[-1], [])
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        kv = self._kv
        with torch.no_grad():
            for i in range(max_tokens):
                logits = self.tokens.full_logits(self.tokens(hidden)[0, -1].float())
                drawn, probs = draw(logits, req.sampling, req.generator)
                if probs is not None:
                    rows.append(probs)
                read = torch.cat([drawn.double(),
                                  controller.draft_numbers(logits).double()]).tolist()
                tokens.append(int(read[0]))
                if i + 1 == max_tokens or not controller.decide(i, read[1:]):
                    break
                pos = torch.tensor([[len(context) - 1 + i]])
                hidden, kv = self.head(hidden, self._embeds([tokens[-1]]), pos, kv)
        return Proposal.chain(context[-1], tokens, torch.stack(rows) if rows else None,
                              forward_calls=len(tokens))

    def commit(self, req: RequestState, path: list[int]) -> None:
        self._sync(req.context)
