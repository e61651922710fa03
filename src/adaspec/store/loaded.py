"""What loading a model gives: the loaded model and what preparing its cache did. Apart from
`store/loading.py` so the quantization cache (which loading calls) can name them without
importing loading back."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class PrepareResult:
    """What `prepare` did, for the CLI and for timing reports."""

    name: str
    dtype: str
    cache_dir: Path
    source: Path | None  # the GGUF (None when a valid cache made it unnecessary to assemble)
    reused: bool  # the cache was already there
    assemble_seconds: float = 0.0
    convert_seconds: float = 0.0  # GGUF dequantize + write safetensors



@dataclass
class LoadedModel:
    """A ready-to-run model: `model` is a transformers CausalLM in eval mode."""

    model: torch.nn.Module
    tokenizer: Any
    name: str
    source: Path  # the GGUF file or HF directory the weights came from
    dtype: str
    cache_dir: Path | None = None  # the safetensors cache actually read (None for an HF dir)
    load_seconds: float = 0.0  # reading the weights (excludes any first-time preparation)
    prepared: PrepareResult | None = None
    quant: str = "none"  # weight quantization of the Linear layers (store/quant.py)

    @property
    def vocab_size(self) -> int:
        """Rows of the output head (may exceed len(tokenizer): Qwen pads to 151,936)."""
        cfg: Any = self.model.config  # a transformers config
        return int(cfg.vocab_size)
