"""Length controllers: how many tokens to draft before verifying. One registry: `ctrl=NAME`
in a method string selects an entry, whose `build` reads the method's typed parameters. The
bench adds `ctrl=oracle` (`lab/bench/oracle.py`), which needs the target's output in advance."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from adaspec.control.base import LengthController
from adaspec.control.confidence import HF_DEFAULT_THRESHOLD, ConfidenceLength
from adaspec.control.heuristic import HeuristicLength
from adaspec.control.static import StaticLength
from adaspec.registry import Registry

if TYPE_CHECKING:
    from adaspec.cost.profile import CostProfile


@dataclass(frozen=True)
class ControllerKind:
    """build(params, profile): params carry k, k_max and the dynamic settings (threshold,
    disco, sl_max, stop, guess); profile prices DISCO's stop=cost."""

    build: Callable[[Any, CostProfile | None], LengthController]
    reads_draft: bool = False  # reads the draft model's distributions (needs draft:)
    summary: str = ""


def _disco(params: Any, profile: CostProfile | None) -> LengthController:
    from adaspec.control.disco import DiscoLength  # loads torch.nn only when used

    tau = params.threshold if params.threshold >= 0 else None
    return DiscoLength.from_file(
        params.disco, tau=tau, sl_max=params.sl_max or None, stop=params.stop,
        profile=profile if params.stop == "cost" else None, guess=params.guess or None,
    )


CONTROLLERS: Registry[ControllerKind] = Registry("length controller")
CONTROLLERS.register("static", ControllerKind(
    lambda p, _: StaticLength(p.k), summary="always k tokens"))
CONTROLLERS.register("heuristic", ControllerKind(
    lambda p, _: HeuristicLength(k=p.k, k_max=max(p.k, p.k_max)),
    summary="k + 2 after a fully accepted draft, k - 1 otherwise (Hugging Face's schedule)"))
CONTROLLERS.register("confidence", ControllerKind(
    lambda p, _: ConfidenceLength(p.threshold if p.threshold >= 0 else HF_DEFAULT_THRESHOLD, p.k),
    reads_draft=True, summary="stop below a top draft probability"))
CONTROLLERS.register("disco", ControllerKind(
    _disco, reads_draft=True,
    summary="DISCO: a trained acceptance classifier stops the draft ([disco.md](docs/disco.md))"))
