"""S2D drafter: each draft token comes from the first sub-model of a sorted draft that is
confident enough (Kavehzadeh et al., "S2D: Sorted Speculative Decoding").

The token is drawn from, and verified against, the distribution of the exit that produced
it: q is that sub-model's, so speculative sampling stays exact whichever exit answers.
"""

from __future__ import annotations

import torch

from adaspec.control.base import LengthController
from adaspec.draft.base import Drafter
from adaspec.draft.model import roll_back_to_common_prefix
from adaspec.draft.sorted_model import ExitState, SortedDraftLM
from adaspec.engine.proposal import Proposal
from adaspec.engine.sampling import SamplingParams, argmax, process_logits, sample


class S2DDrafter(Drafter):
    """Keeps the sorted draft's per-segment caches in step with the accepted context."""

    name = "s2d"

    def __init__(self, model: SortedDraftLM, thresholds: tuple[float, ...],
                 exits: tuple[int, ...] | None = None) -> None:
        exits = tuple(exits or model.config.exits)
        if len(thresholds) != len(exits) - 1:
            raise ValueError(f"{len(exits)} exits need {len(exits) - 1} thresholds (the last "
                             f"exit always answers), got {len(thresholds)}")
        # an exit whose threshold is 0 always answers: the exits after it are never reached
        reach = next((i for i, t in enumerate(thresholds) if t <= 0.0), len(exits) - 1)
        exits, thresholds = exits[: reach + 1], tuple(thresholds[:reach])
        self.model = model
        self.thresholds = (*thresholds, 0.0)
        self.labels = [f"exit {e}" for e in exits]
        self.state = ExitState(model, exits)
        self.max_context = 32768
        self._cached: list[int] = []  # tokens the state holds, in order

    def start(self, prompt_ids: list[int]) -> None:
        """Run the prompt but its last token through every reachable layer in one batched
        pass (cheap per token, and timed as the draft's prefill); from there on, deeper
        layers catch up lazily on the generated tokens that skipped them."""
        self.state.reset()
        head = list(prompt_ids[:-1])
        if head:
            self.state.append(head, full_depth=True)
        self._cached = head

    def _sync(self, context: list[int]) -> None:
        roll_back_to_common_prefix(self.state, self._cached, context)

    def propose(
        self,
        context: list[int],
        max_tokens: int,
        controller: LengthController,
        params: SamplingParams,
        generator: torch.Generator | None,
        replacement: bool = False,
    ) -> Proposal:
        self._sync(context)
        if len(self._cached) == len(context):  # the last token's logits are needed again
            self.state.truncate(len(context) - 1)
            del self._cached[-1:]
        pending = context[len(self._cached):]
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        used: dict[str, int] = {}
        for i in range(max_tokens):
            exit_index, small = self.state.feed(pending, self.thresholds)
            self._cached.extend(pending)
            logits = self.model.full_logits(small)
            if params.greedy:
                token = int(argmax(logits))
            else:
                probs = process_logits(logits, params)
                token = sample(probs, generator)
                rows.append(probs)
            label = self.labels[exit_index]
            used[label] = used.get(label, 0) + 1
            tokens.append(token)
            pending = [token]
            if not controller.keep_drafting(i, logits):
                break
        return Proposal.chain(context[-1], tokens, torch.stack(rows) if rows else None,
                              forward_calls=len(tokens), drafted_by=used)

    def commit(self, context: list[int], path: list[int]) -> None:
        self._sync(context)
