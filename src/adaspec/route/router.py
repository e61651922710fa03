"""The router engine: one prefill of the target, the policy picks an arm from the prompt's
final hidden state, and decoding goes on with that arm's drafter, controller and verifier.

Every arm is an ordinary Engine built (`methods.build`) on the same loaded backends; the
router composes them and adds no decoding code of its own: whatever arm it picks, the output
is that arm's, and so (exactness contract) the target's.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from adaspec.backends.base import ForwardOutput, ModelBackend, common_prefix
from adaspec.core.metrics import RequestStats
from adaspec.core.request import StepHook
from adaspec.core.sampling import SamplingParams
from adaspec.engine.batch import run_alone
from adaspec.engine.loop import Engine, TextGenerator
from adaspec.engine.steps import GenerationResult, StreamChunk, TargetCall
from adaspec.errors import InputError
from adaspec.route.policy import MODES, RouterPolicy

if TYPE_CHECKING:
    from adaspec.cost.batch import Seat


class RoutedGenerator(TextGenerator):
    """Routes each request to one of `arms` (name -> Engine sharing one target): it runs the
    target's prefill itself, asking for the prompt's final hidden state, lets the policy
    pick an arm, and hands that arm's engine the prefilled cache to decode from.

    mode: "greedy" takes the policy's argmax, "dynamic" samples from it (seeded by the
    request's seed mixed with its prompt when it has a seed, else by the router's own
    generator). `force` names an arm to use regardless of the policy (tests, experiments);
    with it no policy is needed.
    """

    def __init__(
        self,
        arms: dict[str, Engine],
        policy: RouterPolicy | None = None,
        mode: str = "greedy",
        seed: int = 0,
        force: str | None = None,
    ) -> None:
        if not arms:
            raise InputError("a router needs at least one arm")
        first = next(iter(arms.values()))
        if any(e.target is not first.target for e in arms.values()):
            raise InputError("every arm of a router must share the same target backend")
        if mode not in MODES:
            raise InputError(f"unknown routing mode {mode!r}; use one of {', '.join(MODES)}")
        if policy is not None and policy.n_arms != len(arms):
            raise InputError(f"the policy scores {policy.n_arms} arms, the router has {len(arms)}")
        self.target = first.target
        self.tokenizer = first.tokenizer
        self.eos_token_ids = set(first.eos_token_ids)
        self.max_context = min(e.max_context for e in arms.values())
        self.arms = dict(arms)
        self.names = list(arms)
        self.policy = policy
        self.mode = mode
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self.force = force
        self.last_state: torch.Tensor | None = None  # the last request's prompt state
        # the last request's prompt and answer: what the target's cache may still hold of
        # the next prompt (a chat template's system turn, a conversation's earlier turns)
        self._last_context: list[int] = []

    def request_done(self) -> None:
        for arm in self.arms.values():
            arm.request_done()

    def learn_with(self, other: TextGenerator) -> None:
        """Share `other`'s arms' estimates and its generator (an unseeded dynamic pick
        draws on from where the method's last request left it, not from the seed again)."""
        if isinstance(other, RoutedGenerator):
            self._generator = other._generator
            for name, arm in self.arms.items():
                if name in other.arms:
                    arm.learn_with(other.arms[name])

    def decode(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams, stop: list[str]
    ) -> Iterator[StreamChunk | GenerationResult]:
        return run_alone(self.steps(prompt_ids, max_new_tokens, sampling, stop))

    def steps(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams,
        stop: list[str], *, seat: Seat | None = None, recorder: StepHook | None = None,
        reuse: int | None = None,
    ) -> Iterator[StreamChunk | GenerationResult | TargetCall]:
        """The prefill with the prompt's state (a call of its own, keeping what the target's
        cache holds of the prompt, up to `reuse` tokens; None: what this router's last
        request left there, as an Engine keeps it), the policy's pick, then the arm's decode
        steps, whose target calls a batch may share with other requests'."""
        if self.force is not None and self.force not in self.arms:
            raise InputError(f"no arm named {self.force!r}; arms: {', '.join(self.names)}")
        if self.force is None and self.policy is None:
            raise InputError("this router has no policy: load an artifact or force an arm")
        for arm in self.arms.values():  # any arm may be picked: each must take the settings
            arm.request_verifier(sampling)
        stats = RequestStats(prompt_tokens=len(prompt_ids))
        if reuse is None:
            reuse = common_prefix(prompt_ids, self._last_context)
        t0 = time.perf_counter()
        prefill = self.target.prefill(
            torch.tensor(prompt_ids), hidden_layer=self.target.num_layers, reuse=reuse
        )
        t1 = time.perf_counter()
        self._last_context = list(prompt_ids)
        stats.cached_tokens = prefill.cached
        name = self._choose(prompt_ids, prefill, sampling)
        stats.prefill_time = t1 - t0
        stats.route = name
        stats.route_time = time.perf_counter() - t1
        for item in self.arms[name].steps(prompt_ids, max_new_tokens, sampling, stop,
                                          prefill=prefill, stats=stats, seat=seat,
                                          recorder=recorder):
            if isinstance(item, GenerationResult):
                self._last_context = [*prompt_ids, *item.token_ids]
            yield item

    def _choose(self, prompt_ids: list[int], prefill: ForwardOutput,
                sampling: SamplingParams) -> str:
        state = prompt_state(prefill, self.target)
        self.last_state = state
        if self.force is not None:
            return self.force
        assert self.policy is not None
        generator = self._generator
        if sampling.seed is not None:  # reproducible per (seed, prompt), varied across prompts
            mixed = zlib.crc32(repr((sampling.seed, prompt_ids)).encode())
            generator = torch.Generator().manual_seed(mixed)
        return self.names[self.policy.choose(state, self.mode, generator)]


def prompt_state(prefill: ForwardOutput, backend: ModelBackend) -> torch.Tensor:
    """The policy's input: the final hidden state [hidden] of the prompt's last token."""
    if prefill.hidden is None:
        raise InputError(
            f"backend {backend.name!r} returned no hidden state: the router needs a backend "
            "that exposes the prompt's final hidden state"
        )
    return prefill.hidden[-1].float()
