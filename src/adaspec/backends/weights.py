"""Which runtime and weights run a model when the user does not say: the fastest exact one
this machine has.

Measured on a 2-core AVX2 EPYC (docs/cost-profile.md): the model's GGUF through
ik_llama.cpp with repacked weights is the fastest single token and by far the flattest
verification curve; mainline llama.cpp (llama-cpp-python) comes next; torch on a CPU without
native bf16 is an order of magnitude slower. So `auto` takes the first of ik_llama.cpp,
llama.cpp and torch (bf16) that is installed and can read the model (a GGUF is needed for the
first two: built-in models and .gguf paths have one, a Hugging Face directory does not).
"""

from __future__ import annotations

import os
from pathlib import Path

AUTO = "auto"


def _has_gguf(name: str) -> bool:
    from adaspec.store.catalog import model_catalog

    if name in model_catalog():
        return True
    path = Path(name).expanduser()
    return path.is_file() and path.suffix == ".gguf"


def _llama_cpp_installed() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except Exception:
        return False
    return True


def best_weights(name: str) -> str:
    """The weights variant `auto` resolves to for model `name`."""
    from adaspec.backends.ikllama import IK, available
    from adaspec.backends.llamacpp import GGUF

    if _has_gguf(name):
        if available():
            return IK
        if _llama_cpp_installed():
            return GGUF
    return "none"


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
