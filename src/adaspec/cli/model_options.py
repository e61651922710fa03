"""The model options every command shares: which target and draft, in which dtype, with which
weight quantization."""

from __future__ import annotations

import argparse

from adaspec.methods import WEIGHT_VARIANTS
from adaspec.models.loading import DTYPES
from adaspec.models.registry import DRAFT_DEFAULT, TARGET_DEFAULT

QUANT_HELP = (
    "weights: none (bf16), int8 / int4 weight-only, int8-dyn (int8 weights and per-token "
    "int8 activations), or gguf (the model's GGUF run by llama.cpp, chains only; needs the "
    "llamacpp extra)"
)


def add_model_options(
    p: argparse.ArgumentParser,
    draft: bool = True,
    quant: bool = True,
    default_from: str | None = None,
) -> None:
    """--target, --draft, --dtype, --quant and --draft-quant, defined once for every command.

    draft=False leaves out the draft's two flags. Commands that read a trained artifact pass
    default_from (what names the pair, e.g. "the artifact"): --target and --draft then
    default to None, meaning that pair; quant=False leaves out --quant / --draft-quant for
    commands that take the quantization from such a file too."""
    where = "built-in model name, HF model directory or .gguf path"
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
        p.add_argument("--quant", default="none", choices=WEIGHT_VARIANTS,
                       help=f"target {QUANT_HELP}")
        if draft:
            p.add_argument("--draft-quant", default="none", choices=WEIGHT_VARIANTS,
                           help="draft weight quantization (same choices as --quant)")
