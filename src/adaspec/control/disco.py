"""DISCO length controller: after each drafted token a small classifier reads the draft's
distribution features and gives the probability that the token will be accepted.

Two stop rules read that probability:
- `tau` (the paper's, the default): hand over to the target once it falls below tau. Tau and
  SL_max come from the tuned artifact (`adaspec disco tune`) unless the method string
  overrides them. The rule treats verification as free: on a CPU where every verified token
  costs a good part of a forward pass, one tau cannot be right for every draft length.
- `cost`: weigh the acceptance probability of one more token against what it costs on this
  machine (one draft forward + the marginal verification cost, from the cost profile): keep
  drafting while the step's expected tokens per millisecond would rise. The next token's
  probability is unknown before it is drafted, so it is guessed: the last probability, or
  the request's running mean of them.
"""

from __future__ import annotations

import torch

from adaspec.control.base import LengthController
from adaspec.control.cursor import GenerationCursor
from adaspec.control.disco_artifact import DiscoArtifact
from adaspec.control.disco_features import assemble, distribution_features
from adaspec.cost.profile import CostProfile
from adaspec.cost.rule import cost_keeps_drafting
from adaspec.errors import InputError

STOP_RULES = ("tau", "cost")
GUESSES = ("last", "mean")  # the cost rule's guess of the next token's acceptance
COST_SL_MAX = 8  # the cost rule's cap when neither the method nor the artifact sets one
def tuned_cost_rule(artifact: DiscoArtifact) -> dict:
    """The cost rule's cap and guess chosen by `adaspec disco tune` (empty before)."""
    return dict((artifact.tuning.get("best") or {}).get("disco-cost") or {})


class DiscoLength(LengthController):
    name = "disco"

    def __init__(
        self,
        artifact: DiscoArtifact,
        tau: float | None = None,
        sl_max: int | None = None,
        stop: str = "tau",
        profile: CostProfile | None = None,
        guess: str | None = None,
    ) -> None:
        self.artifact = artifact
        if stop not in STOP_RULES:
            raise InputError(f"DISCO stop rule {stop!r}: use one of {', '.join(STOP_RULES)}")
        self.stop = stop
        self.tau = artifact.tau if tau is None else tau
        if not 0.0 <= self.tau <= 1.0:
            raise InputError(f"DISCO threshold tau must be in [0, 1], got {self.tau}")
        tuned = tuned_cost_rule(artifact) if stop == "cost" else {}
        if sl_max is None:
            sl_max = int(tuned.get("sl_max", COST_SL_MAX)) if stop == "cost" else artifact.sl_max
        self.sl_max = sl_max
        if self.sl_max < 1:
            raise InputError(f"DISCO sl_max must be >= 1, got {self.sl_max}")
        self.guess = guess or str(tuned.get("guess", "last"))
        if self.guess not in GUESSES:
            raise InputError(f"DISCO guess {self.guess!r}: use one of {', '.join(GUESSES)}")
        self.profile = profile
        self.step_ms: list[float] = []
        if stop == "cost":
            if profile is None:
                raise InputError("DISCO's stop=cost prices each step with a cost profile: "
                                 "give profile=FILE|flat, or build it with build_generator")
            if profile.draft is None:
                raise InputError("DISCO's stop=cost needs a cost profile that measured the "
                                 "draft (adaspec profile, with a draft model)")
            # Priced once, at the profile's first context length: the controller does not
            # see the context, and the rule only compares lengths within one step.
            self.step_ms = [profile.step_ms(n, n) for n in range(self.sl_max + 1)]
        self.cursor = GenerationCursor()
        self.builtin = False  # the classifier shipped for the built-in pair
        self.last_probability: float | None = None
        self._step: list[float] = []  # this step's acceptance probabilities
        self._sum, self._count = 0.0, 0  # the request's, for guess=mean

    @classmethod
    def from_file(
        cls,
        path: str,
        tau: float | None = None,
        sl_max: int | None = None,
        stop: str = "tau",
        profile: CostProfile | None = None,
        guess: str | None = None,
    ):
        """path "": the classifier shipped for the built-in pair (`control/builtin`)."""
        from adaspec.control.builtin import DISCO_BUILTIN

        builtin = not path
        if builtin and not DISCO_BUILTIN.is_file():
            raise InputError(
                "ctrl=disco needs disco=PATH, an artifact that `adaspec disco collect`, "
                "`disco train` and `disco tune` build (docs/disco.md)"
            )
        controller = cls(DiscoArtifact.load(path or DISCO_BUILTIN), tau, sl_max, stop,
                         profile, guess)
        controller.builtin = builtin
        return controller

    def check_models(self, target: str, draft: str) -> None:
        """Called by build_generator with the backends' names."""
        try:
            self.artifact.check_pair(target, draft)
        except InputError as exc:
            if not self.builtin:
                raise
            raise InputError(
                f"the DISCO classifier shipped with adaspec is for draft {self.artifact.draft!r}"
                f" with target {self.artifact.target!r}; for draft {draft!r} with target "
                f"{target!r} build one (adaspec disco collect / train / tune, docs/disco.md) "
                "and pass disco=PATH"
            ) from exc

    def begin(self) -> None:
        self.cursor.begin()
        self._step = []
        self._sum, self._count = 0.0, 0

    def max_tokens(self) -> int:
        self.cursor.begin_step()
        self._step = []
        return self.sl_max

    def draft_numbers(self, draft_logits: torch.Tensor) -> torch.Tensor:
        return distribution_features(draft_logits)

    @torch.inference_mode()
    def decide(self, position: int, numbers: list[float]) -> bool:
        self.needs_distribution(numbers)
        x = assemble(
            torch.tensor(numbers, dtype=torch.float32),
            position,
            self.cursor.next + position,
            self.artifact.spec,
        )
        p = float(self.artifact.classifier.accept_probability(x))
        self.last_probability = p
        if self.stop == "tau":
            return p >= self.tau
        del self._step[position:]  # robust to a drafter that did not begin with max_tokens
        self._step.append(p)
        self._sum += p
        self._count += 1
        guess = p if self.guess == "last" else self._sum / self._count
        return cost_keeps_drafting(self._step, guess, self.step_ms, self.sl_max)

    def update(self, drafted: int, accepted: int) -> None:
        self.cursor.end_step(accepted)
