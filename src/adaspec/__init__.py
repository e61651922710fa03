"""adaspec: adaptive speculative decoding with output exactly the target model's.

    from adaspec import load_generator
    generator = load_generator()           # method "auto", the built-in pair, the fastest runtime
    print(generator.generate("Reverse a linked list in Python.").text)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adaspec.core.openmp import load_torch

load_torch()  # before anything imports torch: how long its OpenMP threads spin (core/openmp)

from adaspec.core.grammar import Grammar  # noqa: E402
from adaspec.core.sampling import SamplingParams  # noqa: E402
from adaspec.errors import AdaspecError, InputError, ModelStoreError  # noqa: E402

if TYPE_CHECKING:
    from adaspec.engine.loop import Engine
    from adaspec.engine.steps import GenerationResult, StreamChunk
    from adaspec.methods.build import build_generator, load_generator

# Loaded on first use, so `import adaspec` stays cheap.
_LAZY = {
    "load_generator": "adaspec.methods.build",
    "build_generator": "adaspec.methods.build",
    "Engine": "adaspec.engine.loop",
    "GenerationResult": "adaspec.engine.steps",
    "StreamChunk": "adaspec.engine.steps",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'adaspec' has no attribute {name!r}")


__all__ = [
    "AdaspecError",
    "Engine",
    "GenerationResult",
    "Grammar",
    "InputError",
    "ModelStoreError",
    "SamplingParams",
    "StreamChunk",
    "build_generator",
    "load_generator",
]
__version__ = "0.1.0"
