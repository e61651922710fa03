"""The model options every command shares: which target and draft, in which dtype, with which
weight quantization."""

from __future__ import annotations

import argparse

from adaspec.backends.weights import AUTO
from adaspec.methods.spec import WEIGHT_VARIANTS
from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT
from adaspec.store.loading import DTYPES

QUANT_HELP = (
    "weights: auto (default: the fastest this machine has, ik > gguf > none), none (bf16 "
    "torch), int8 / int4 weight-only, int8-dyn (int8 weights and per-token int8 "
    "activations), gguf (the model's GGUF run by llama.cpp, chains only; the llamacpp "
    "extra) or ik (the GGUF run by ik_llama.cpp with repacked weights, chains only)"
)


def add_model_options(
    p: argparse.ArgumentParser,
    draft: bool = True,
    quant: bool = True,
    default_from: str | None = None,
    default_quant: str = AUTO,
) -> None:
    """--target, --draft, --dtype, --quant and --draft-quant, defined once for every command.

    draft=False leaves out the draft's two flags. Commands that read a trained artifact pass
    default_from (what names the pair, e.g. "the artifact"): --target and --draft then
    default to None, meaning that pair; quant=False leaves out --quant / --draft-quant for
    commands that take the quantization from such a file too. default_quant: the weights
    when --quant is not given (`auto`: the fastest this machine has)."""
    where = "built-in model name, HF model directory or .gguf path"
    defaults: tuple[str | None, str | None]
    if default_from is None:
        defaults = (TARGET_DEFAULT, DRAFT_DEFAULT)
    else:
        defaults = (None, None)
        where += f" (default: the one {default_from} names)"
    p.add_argument("--target", default=defaults[0], help=f"target: {where}")
    if draft:
        p.add_argument("--draft", default=defaults[1], help=f"draft model: {where}")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    if quant:
        p.add_argument("--quant", default=default_quant, choices=(AUTO, *WEIGHT_VARIANTS),
                       help=f"target {QUANT_HELP}")
        if draft:
            p.add_argument("--draft-quant", default=default_quant, choices=(AUTO, *WEIGHT_VARIANTS),
                           help="draft weight quantization (same choices as --quant)")
