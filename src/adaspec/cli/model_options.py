"""The model options every command shares: which target and draft, in which dtype, with which
weight quantization."""

from __future__ import annotations

import argparse

from adaspec.build import DEFAULT_DRAFT, DEFAULT_TARGET
from adaspec.models.loading import DTYPES
from adaspec.models.quant import QUANT_MODES

QUANT_HELP = (
    "weight quantization: none (bf16), int8 / int4 weight-only, int8-dyn (int8 weights and "
    "per-token int8 activations: verifying a draft costs about one forward)"
)


def add_model_options(p: argparse.ArgumentParser, draft: bool = True) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help="built-in model name, HF model directory or .gguf path")
    if draft:
        p.add_argument("--draft", default=DEFAULT_DRAFT,
                       help="draft model: built-in name, HF directory or .gguf path")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--quant", default="none", choices=QUANT_MODES,
                   help=f"target {QUANT_HELP}")
    if draft:
        p.add_argument("--draft-quant", default="none", choices=QUANT_MODES,
                       help="draft weight quantization (same choices as --quant)")
