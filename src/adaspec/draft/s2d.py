"""S2D drafter: each draft token comes from the first sub-model of a sorted draft that is
confident enough (Kavehzadeh et al., "S2D: Sorted Speculative Decoding").

The token is drawn from, and verified against, the distribution of the exit that produced
it: q is that sub-model's, so speculative sampling stays exact whichever exit answers.
"""

from __future__ import annotations

import torch

from adaspec.control.base import LengthController
from adaspec.core.proposal import Proposal
from adaspec.core.request import RequestState
from adaspec.draft.model import ModelDrafter
from adaspec.draft.sorted_model import ExitState, SortedDraftLM


class S2DDrafter(ModelDrafter):
    """A chain drafter whose "backend" is the sorted draft's per-segment state: only the
    prompt prefill and the forward step differ from a model draft's, and each proposal
    counts the tokens each exit drafted."""

    name = "s2d"
    chains_on_device = False  # the exit rule reads each token's confidence

    def __init__(self, model: SortedDraftLM, thresholds: tuple[float, ...],
                 exits: tuple[int, ...] | None = None) -> None:
        exits = tuple(exits or model.config.exits)
        if len(thresholds) != len(exits) - 1:
            raise ValueError(f"{len(exits)} exits need {len(exits) - 1} thresholds (the last "
                             f"exit always answers), got {len(thresholds)}")
        # an exit whose threshold is 0 always answers: the exits after it are never reached
        reach = next((i for i, t in enumerate(thresholds) if t <= 0.0), len(exits) - 1)
        exits, thresholds = exits[: reach + 1], tuple(thresholds[:reach])
        super().__init__(ExitState(model, exits))  # type: ignore[arg-type]  # why: duck-typed
        self.model = model
        self.thresholds = (*thresholds, 0.0)
        self.labels = [f"exit {e}" for e in exits]
        self._used: dict[str, int] = {}  # tokens per exit in the proposal being drafted

    @property
    def state(self) -> ExitState:
        return self.backend  # type: ignore[return-value]  # why: the ExitState given to __init__

    def begin(self, req: RequestState) -> None:
        """Run the prompt but its last token through every reachable layer in one batched
        pass (cheap per token, and timed as the draft's prefill); from there on, deeper
        layers catch up lazily on the generated tokens that skipped them."""
        self.state.reset()
        head = list(req.prompt_ids[:-1])
        if head:
            self.state.append(head, full_depth=True)
        self._cached = head

    def step(self, tokens: list[int]) -> torch.Tensor:
        """The exits' logits, where the sorted draft runs (the target's device)."""
        exit_index, small = self.state.feed(tokens, self.thresholds)
        self._cached.extend(tokens)
        label = self.labels[exit_index]
        self._used[label] = self._used.get(label, 0) + 1
        return self.model.full_logits(small)

    def propose(self, req: RequestState, max_tokens: int,
                controller: LengthController) -> Proposal:
        self._used = {}
        proposal = super().propose(req, max_tokens, controller)
        proposal.drafted_by = self._used
        return proposal
