"""The oracle speculation length, for the bench: draft exactly the tokens the target will
accept. It needs to know, for the request at hand, where the draft's greedy token equals the
target's greedy output (teacher-forced hits, `lab.bench.theory.teacher_forced_hits`); the bench
hands them over with `set_hits` before each request, from plain decoding's output."""

from __future__ import annotations

from collections.abc import Sequence

from adaspec.control import CONTROLLERS, ControllerKind
from adaspec.control.base import LengthController
from adaspec.control.cursor import GenerationCursor
from adaspec.errors import InputError


class OracleLength(LengthController):
    name = "oracle"

    def __init__(self, k_max: int = 64) -> None:
        if k_max < 1:
            raise InputError(f"oracle needs k_max >= 1, got {k_max}")
        self.k_max = k_max
        self.hits: list[bool] | None = None
        self.cursor = GenerationCursor()

    def set_hits(self, hits: Sequence[bool]) -> None:
        """hits[i]: the draft's greedy token after the true prefix equals output token i."""
        self.hits = [bool(h) for h in hits]

    def begin(self) -> None:
        if self.hits is None:
            raise InputError(
                "ctrl=oracle needs the target's reference output, which only the bench has "
                "(adaspec bench / adaspec disco bench run it after `ar`)"
            )
        self.cursor.begin()

    def max_tokens(self) -> int:
        assert self.hits is not None
        p = self.cursor.begin_step()
        run = 0
        while run < self.k_max and p + run < len(self.hits) and self.hits[p + run]:
            run += 1
        return run  # 0: the target decodes this token alone

    def update(self, drafted: int, accepted: int) -> None:
        self.cursor.end_step(accepted)


# `ctrl=oracle` in a method string, wherever the bench is loaded (`lab.bench.references`)
if "oracle" not in CONTROLLERS:
    CONTROLLERS.register("oracle", ControllerKind(
        lambda s, _: OracleLength(k_max=s.k_max), reads_draft=True,
        summary="the length the target would accept (measurement only)"))
