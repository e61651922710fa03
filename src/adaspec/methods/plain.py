"""`ar`: plain target decoding through the same loop (the baseline every method is measured
and checked against)."""

from __future__ import annotations

from adaspec.methods.base import Method, Models
from adaspec.methods.params import NoParams


def _build(params: NoParams, models: Models, text: str):
    from adaspec.engine.loop import Engine

    return Engine(models.target, models.tokenizer, eos_token_ids=models.eos_token_ids)


METHOD = Method(
    "ar",
    "plain target decoding through the same loop (the baseline)",
    NoParams,
    _build,
    drafts_with="target",
    doc="docs/exactness.md",
)
