"""`ngram`: prompt lookup decoding (no draft model)."""

from __future__ import annotations

from dataclasses import dataclass

from adaspec.errors import InputError
from adaspec.methods.base import Method, Models
from adaspec.methods.params import ChainParams, check, param


@dataclass(frozen=True)
class NgramParams(ChainParams):
    k: int = param(8, "tokens to propose per step")
    n_max: int = param(3, "longest n-gram to match")
    n_min: int = param(1, "shortest n-gram to match")

    def __post_init__(self) -> None:
        from adaspec.control import CONTROLLERS

        super().__post_init__()
        if CONTROLLERS[self.ctrl].reads_draft:
            raise InputError(f"ctrl={self.ctrl} needs the draft model (draft:)")
        check(1 <= self.n_min <= self.n_max, "need 1 <= n_min <= n_max")


def _build(params: NgramParams, models: Models, text: str):
    from adaspec.control import CONTROLLERS
    from adaspec.draft.ngram import NgramDrafter
    from adaspec.engine.loop import Engine

    return Engine(
        models.target,
        models.tokenizer,
        drafter=NgramDrafter(n_max=params.n_max, n_min=params.n_min),
        controller=CONTROLLERS[params.ctrl].build(params.length_settings(), None),
        verify=params.verify,
        eos_token_ids=models.eos_token_ids,
    )


METHOD = Method(
    "ngram",
    "prompt lookup: propose what followed the last match of the context's final n-gram",
    NgramParams,
    _build,
    drafts_with="nothing",
    doc="docs/ngram.md",
)
