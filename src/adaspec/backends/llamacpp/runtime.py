"""The llama.cpp runtime's registration (`backends/runtimes.py`): a model's GGUF through
llama-cpp-python, in a child process."""

from __future__ import annotations

from collections.abc import Callable

from adaspec.backends.base import Loaded, LoadRequest, Runtime
from adaspec.backends.device import CPU
from adaspec.backends.weights import GGUF


def _can_run(name: str) -> bool:
    from adaspec.backends import weights  # looked up at the call (a test stands in for it)

    return weights.has_gguf(name) and weights.llama_cpp_installed()


def _start(req: LoadRequest) -> Callable[[], Loaded]:
    from adaspec.backends.gguf import gguf_backend_args
    from adaspec.backends.llamacpp.backend import DEFAULT_CONTEXT, LlamaCppBackend, import_llama
    from adaspec.backends.process_backend import start_in_child
    from adaspec.backends.weights import llama_threads

    # fails fast (package missing, no GGUF), before a child process starts
    args = gguf_backend_args(req.name, llama_threads(), DEFAULT_CONTEXT, import_llama)
    return start_in_child(LlamaCppBackend, args, req)


RUNTIME = Runtime("llama.cpp", (GGUF,), (CPU,), _can_run, _start)
