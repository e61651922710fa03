"""`head`: chains from a draft head over the target's own features (EAGLE's shape).

The head (`draft/head_model.py`) is one small decoder layer that reads the hidden states the
verification pass already computed, so a draft token costs a few percent of a target step
instead of a draft model's 40-80%. It needs a runtime that returns those states beside the
logits (ik_llama.cpp with the `target-features` patch, torch) and a trained head for the
target: the built-in pair's ships with adaspec; `adaspec head data` / `adaspec head train`
make one for another target (docs/head.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from adaspec.errors import InputError
from adaspec.methods.base import Method, Models
from adaspec.methods.params import ChainParams, check, param

if TYPE_CHECKING:
    from adaspec.control import LengthSettings
    from adaspec.control.base import LengthController
    from adaspec.draft.base import Drafter


def check_weights(weights: str) -> None:
    from adaspec.draft.head import WEIGHTS

    check(weights in ("default", *WEIGHTS),
          f"weights must be one of default, {', '.join(WEIGHTS)}")



CTRLS = ("static", "heuristic", "confidence", "disco")
PRICED_TREE = "priced"  # head:tree=priced


@dataclass(frozen=True)
class HeadParams(ChainParams):
    k: int = param(3, "tokens to draft per step (the most with ctrl=confidence)")
    ctrl: str = param("static", "length controller: static | heuristic | confidence | disco")
    threshold: float = param(0.0, "ctrl=confidence: stop below this top probability; "
                             "ctrl=disco: tau, stop below this acceptance probability (0: "
                             "the controller's default, the artifact's tuned tau)")
    disco: str = param("", "ctrl=disco: the classifier from `adaspec head disco` (default: "
                       "the one shipped with the built-in head)")
    sl_max: int = param(0, "ctrl=disco: most tokens per draft (0: the artifact's tuned one)")
    artifact: str = param("", "the head's file (default: the one shipped for the target)")
    weights: str = param("default", "the head's weights at run time: default (ggml where the "
                         "target runs in ik_llama.cpp, else int8) | fp32 | bf16 | int8 (int8 "
                         "rows, bf16 activations) | int8-dyn | ggml (its layer in ik_llama.cpp)")
    tree: str = param("", "a token tree along the chain: candidates per level, e.g. 3x2 (3 "
                      "at depth 1, 2 at depth 2, one deeper, up to k), or priced (each step "
                      "the nodes with the most expected tokens per ms under the cost "
                      "profile); verified in one target pass (MCSS above temperature 0)")
    profile: str = param("", "tree=priced: the cost profile (a JSON file, 'flat' or "
                         "'linear:...'; default: this machine's, measured once and cached)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.ctrl in CTRLS,
              f"ctrl={self.ctrl} is not for the head ({', '.join(CTRLS)})")
        check(0.0 <= self.threshold <= 1.0, "threshold must be in [0, 1]")
        check(self.sl_max >= 0, "sl_max must be >= 0")
        if self.ctrl != "disco" and (self.disco or self.sl_max):
            raise InputError("disco and sl_max are ctrl=disco's settings")
        check_weights(self.weights)
        self.widths()

    def widths(self) -> tuple[int, ...]:
        """tree=AxB...: the candidates per level (empty: a chain, or tree=priced)."""
        check(not self.profile or self.tree == PRICED_TREE, "profile prices tree=priced only")
        if not self.tree or self.tree == PRICED_TREE:
            return ()
        try:
            widths = tuple(int(w) for w in self.tree.lower().split("x"))
        except ValueError:
            raise InputError(f"tree={self.tree}: candidates per level, e.g. tree=3x2") from None
        check(all(1 <= w <= 16 for w in widths) and sum(widths) <= 63,
              f"tree={self.tree}: 1 to 16 candidates per level, at most 63 in all")
        return widths

    def length_settings(self) -> LengthSettings:
        """k, the threshold, and for ctrl=disco its artifact (the threshold is its tau)."""
        from adaspec.control import DiscoSettings

        settings = super().length_settings()
        threshold = self.threshold or None
        if self.ctrl != "disco":
            return replace(settings, threshold=threshold)
        return replace(settings, disco=DiscoSettings(self.disco, tau=threshold,
                                                     sl_max=self.sl_max or None))


def _artifact_path(params: HeadParams, target_name: str) -> Path:
    from adaspec.draft.head_artifact import builtin_for

    if params.artifact:
        path = Path(params.artifact).expanduser()
        if not path.is_file():
            raise InputError(f"draft head not found: {path}")
        return path
    shipped = builtin_for(target_name)
    if shipped is None:
        raise InputError(
            f"no draft head ships for {target_name}: make one with `adaspec head data "
            f"--target {target_name} --out DATA` then `adaspec head train --target "
            f"{target_name} --data DATA --out head.pt`, and pass head:artifact=head.pt")
    return shipped


def _check(params: HeadParams, models: Models, text: str) -> None:
    target = models.target
    if not target.has_features:
        raise InputError(
            f"the head reads the target's hidden states, which runtime {target.kind} does not "
            f"return (use the torch runtime, or ik_llama.cpp built with its features patch: "
            f"adaspec runtime build)")
    _artifact_path(params, target.name)
    if params.tree and not target.supports_trees:
        raise InputError(
            f"head:tree needs a target runtime that scores token trees, which {target.kind} "
            f"does not (torch, or ik_llama.cpp built with its tree patch: adaspec runtime "
            f"build --force)")


def _controller(params: HeadParams, target: str, head: Path) -> LengthController:
    """The length controller; DISCO's classifier read for this head only (the one shipped
    with the built-in head where disco= is not given)."""
    from adaspec.control import CONTROLLERS
    from adaspec.control.builtin import head_disco_file
    from adaspec.draft.head_artifact import fingerprint

    settings = params.length_settings()
    if params.ctrl != "disco":
        return CONTROLLERS[params.ctrl].build(settings, None)
    disco = settings.disco
    assert disco is not None
    shipped = head_disco_file(target)
    make = (f"make one with `adaspec head disco --head {head} --out disco.pt` and pass "
            f"head:ctrl=disco,disco=disco.pt")
    if not disco.artifact:
        if not shipped.is_file():
            raise InputError(f"no DISCO classifier ships for the head of {target}: {make}")
        disco = replace(disco, artifact=str(shipped))
    controller = CONTROLLERS["disco"].build(replace(settings, disco=disco), None)
    try:
        controller.check_models(target, fingerprint(head))  # type: ignore[attr-defined]
    except InputError:
        raise InputError(f"the DISCO classifier {disco.artifact} was trained for another "
                         f"head or target than {head} of {target}: {make}") from None
    return controller


def _build(params: HeadParams, models: Models, text: str):
    from adaspec.draft.head_ggml import load_drafter
    from adaspec.engine.loop import Engine

    path = _artifact_path(params, models.target.name)
    head = load_drafter(path, models.target, params.weights)
    drafter: Drafter = head
    if params.tree == PRICED_TREE:
        from adaspec.draft.head_tree import PricedHeadTree

        drafter = PricedHeadTree(head, models.cost_profile(params.profile, with_draft=False))
    elif params.tree:
        from adaspec.draft.head_tree import HeadTreeDrafter

        drafter = HeadTreeDrafter(head, params.widths())
    return Engine(
        models.target,
        models.tokenizer,
        drafter=drafter,
        controller=_controller(params, models.target.name, path),
        verify=params.verify,
        eos_token_ids=models.eos_token_ids,
    )


def head_parameters(artifact: str, target_name: str) -> int:
    """Parameters a token drafted by the head runs through (`artifact`: its file, or the
    shipped one for the target)."""
    from adaspec.draft.head_artifact import load

    return load(_artifact_path(HeadParams(artifact=artifact), target_name)).parameters


def _parameters(params: HeadParams, target_name: str, draft_params: int | None) -> int:
    return head_parameters(params.artifact, target_name)


METHOD = Method(
    "head",
    "a draft head over the target's own hidden states (EAGLE-style): a draft token for about "
    "a tenth of a target step",
    HeadParams,
    _build,
    check_models=_check,
    own_parameters=_parameters,
    doc="docs/head.md",
)
