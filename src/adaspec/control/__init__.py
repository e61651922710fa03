"""Length controllers: how many tokens to draft before verifying. One registry: `ctrl=NAME`
in a method string selects an entry, whose `build` reads the `LengthSettings` the method's
parameters give (`ChainParams.length_settings`). The bench adds `ctrl=oracle`
(`lab/bench/oracle.py`), which needs the target's output in advance."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from adaspec.control.base import LengthController
from adaspec.control.confidence import HF_DEFAULT_THRESHOLD, ConfidenceLength
from adaspec.control.heuristic import HeuristicLength
from adaspec.control.static import StaticLength
from adaspec.registry import Registry

if TYPE_CHECKING:
    from adaspec.cost.profile import CostProfile


@dataclass(frozen=True)
class DiscoSettings:
    """ctrl=disco's settings: the artifact, and what overrides its tuned values (None: the
    artifact's)."""

    artifact: str
    tau: float | None = None  # stop=tau: stop below this acceptance probability
    sl_max: int | None = None  # most tokens per draft
    stop: str = "tau"  # tau | cost
    guess: str | None = None  # stop=cost: last | mean


@dataclass(frozen=True)
class LengthSettings:
    """What a length controller is built from: k and its bound, the confidence threshold
    (None: the controller's default), and DISCO's settings (ctrl=disco only)."""

    k: int
    k_max: int
    threshold: float | None = None
    disco: DiscoSettings | None = None


@dataclass(frozen=True)
class ControllerKind:
    """build(settings, profile): profile prices DISCO's stop=cost."""

    build: Callable[[LengthSettings, CostProfile | None], LengthController]
    reads_draft: bool = False  # reads the draft model's distributions (needs draft:)
    summary: str = ""


def _disco(settings: LengthSettings, profile: CostProfile | None) -> LengthController:
    from adaspec.control.disco import DiscoLength  # loads torch.nn only when used

    disco = settings.disco or DiscoSettings("")  # no artifact: from_file says how to make one
    return DiscoLength.from_file(
        disco.artifact, tau=disco.tau, sl_max=disco.sl_max, stop=disco.stop,
        profile=profile if disco.stop == "cost" else None, guess=disco.guess,
    )


CONTROLLERS: Registry[ControllerKind] = Registry("length controller")
CONTROLLERS.register("static", ControllerKind(
    lambda s, _: StaticLength(s.k), summary="always k tokens"))
CONTROLLERS.register("heuristic", ControllerKind(
    lambda s, _: HeuristicLength(k=s.k, k_max=s.k_max),
    summary="k + 2 after a fully accepted draft, k - 1 otherwise (Hugging Face's schedule)"))
CONTROLLERS.register("confidence", ControllerKind(
    lambda s, _: ConfidenceLength(HF_DEFAULT_THRESHOLD if s.threshold is None else s.threshold,
                                  s.k),
    reads_draft=True, summary="stop below a top draft probability"))
CONTROLLERS.register("disco", ControllerKind(
    _disco, reads_draft=True,
    summary="DISCO: a trained acceptance classifier stops the draft ([disco.md](docs/disco.md))"))
