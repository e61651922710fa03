"""`head`: chains from a draft head over the target's own features (EAGLE's shape).

The head (`draft/head_model.py`) is one small decoder layer that reads the hidden states the
verification pass already computed, so a draft token costs a few percent of a target step
instead of a draft model's 40-80%. It needs a runtime that returns those states beside the
logits (ik_llama.cpp with the `target-features` patch, torch) and a trained head for the
target: the built-in pair's ships with adaspec; `adaspec head data` / `adaspec head train`
make one for another target (docs/head.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from adaspec.errors import InputError
from adaspec.methods.base import Method, Models
from adaspec.methods.params import ChainParams, check, param


def check_weights(weights: str) -> None:
    from adaspec.draft.head import WEIGHTS

    check(weights in WEIGHTS, f"weights must be one of {', '.join(WEIGHTS)}")



@dataclass(frozen=True)
class HeadParams(ChainParams):
    k: int = param(3, "tokens to draft per step (the most with ctrl=confidence)")
    ctrl: str = param("static", "length controller: static | heuristic | confidence")
    threshold: float = param(0.0, "ctrl=confidence: stop below this top probability "
                             "(0: the controller's default)")
    artifact: str = param("", "the head's file (default: the one shipped for the target)")
    weights: str = param("int8", "the head's weights at run time: fp32 | bf16 | int8 (int8 "
                         "rows, bf16 activations) | int8-dyn")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.ctrl in ("static", "heuristic", "confidence"),
              f"ctrl={self.ctrl} is not for the head (static, heuristic or confidence)")
        check(0.0 <= self.threshold <= 1.0, "threshold must be in [0, 1]")
        check_weights(self.weights)


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


def _build(params: HeadParams, models: Models, text: str):
    from dataclasses import replace

    from adaspec.control import CONTROLLERS
    from adaspec.draft.head import HeadDrafter
    from adaspec.engine.loop import Engine

    drafter = HeadDrafter.load(_artifact_path(params, models.target.name), models.target,
                               params.weights)
    settings = params.length_settings()
    if params.threshold:
        settings = replace(settings, threshold=params.threshold)
    return Engine(
        models.target,
        models.tokenizer,
        drafter=drafter,
        controller=CONTROLLERS[params.ctrl].build(settings, None),
        verify=params.verify,
        eos_token_ids=models.eos_token_ids,
    )


METHOD = Method(
    "head",
    "a draft head over the target's own hidden states (EAGLE-style): a draft token for about "
    "a tenth of a target step",
    HeadParams,
    _build,
    check_models=_check,
    drafts_with="nothing",
    doc="docs/head.md",
)
