"""The weights variants a model can run with (`--weights`, `--draft-weights`, a method's
`@...`): a torch weight quantization, the model's GGUF on llama.cpp or ik_llama.cpp, or
`fastest`, the default: the fastest exact runtime this machine has.

Measured on a 2-core AVX2 EPYC (docs/cost-profile.md): the model's GGUF through
ik_llama.cpp with repacked weights is the fastest single token and by far the flattest
verification curve; mainline llama.cpp (llama-cpp-python) comes next; torch on a CPU without
native bf16 is an order of magnitude slower. So `fastest` takes the first of ik_llama.cpp,
llama.cpp and torch (bf16) that is installed and can read the model (a GGUF is needed for the
first two: built-in models and .gguf paths have one, a Hugging Face directory does not).
"""

from __future__ import annotations

import os
from pathlib import Path

from adaspec.errors import InputError
from adaspec.store.quant import QUANT_MODES

FASTEST = "fastest"
GGUF = "gguf"  # the model's GGUF run by llama.cpp (`llamacpp/`)
IK = "ik"  # the model's GGUF run by ik_llama.cpp (`ik/`), weights repacked
STATIC = "static"  # the model's own dtype on the static-cache torch runtime (`torch/static.py`)
# What may follow a method's `@` and what --weights names besides `fastest`: torch weight
# quantizations, or the GGUF run by llama.cpp (`gguf`) or by ik_llama.cpp (`ik`).
WEIGHT_VARIANTS = (*QUANT_MODES, GGUF, IK, STATIC)
WEIGHTS_CHOICES = (FASTEST, *WEIGHT_VARIANTS)
# `fastest` was called `auto` (a word now left to the method `auto`): older command lines and
# files (a bench run.json, a DISCO dataset, a router collection) may still say it.
OLD_FASTEST = "auto"


def read_weights(value: str) -> str:
    """A weights value as an older version wrote it: `auto` is `fastest` now."""
    return FASTEST if value == OLD_FASTEST else value


def check_weights(value: str) -> str:
    """`value` if it names weights (`fastest` or a variant), else an InputError naming them."""
    if value == OLD_FASTEST:
        raise InputError(f"weights {OLD_FASTEST!r} are now called {FASTEST!r}")
    if value not in WEIGHTS_CHOICES:
        raise InputError(f"unknown weights {value!r}; use one of {', '.join(WEIGHTS_CHOICES)}")
    return value


def has_gguf(name: str) -> bool:
    from adaspec.store.catalog import model_catalog

    if name in model_catalog():
        return True
    path = Path(name).expanduser()
    return path.is_file() and path.suffix == ".gguf"


def llama_cpp_installed() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except Exception:
        return False
    return True


def llama_threads() -> int:
    """Threads for a llama.cpp-family runtime: every core this process may use
    (`ADASPEC_THREADS` overrides)."""
    env = os.environ.get("ADASPEC_THREADS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            pass
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)
