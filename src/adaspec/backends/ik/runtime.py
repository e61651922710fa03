"""The ik_llama.cpp runtime's registration (`backends/runtimes.py`): a model's GGUF, weights
repacked, in a child process; several sequences in one pool of KV cells."""

from __future__ import annotations

from collections.abc import Callable

from adaspec.backends.base import Loaded, LoadRequest, Runtime
from adaspec.backends.device import CPU
from adaspec.backends.weights import IK, has_gguf


def _can_run(name: str) -> bool:
    from adaspec.backends.ik.backend import available

    return has_gguf(name) and available()


def _start(req: LoadRequest) -> Callable[[], Loaded]:
    from adaspec.backends.gguf import gguf_backend_args
    from adaspec.backends.ik.backend import IkLlamaBackend, context_for, library, target_min_rows
    from adaspec.backends.process_backend import start_in_child
    from adaspec.backends.weights import llama_threads

    # fails fast (package missing, no GGUF), before a child process starts; a target's
    # blocks decided at load (exact greedy)
    args = (*gguf_backend_args(req.name, llama_threads(), context_for(req.sequences), library),
            True, target_min_rows() if req.role == "target" else 1, req.sequences)
    return start_in_child(IkLlamaBackend, args, req)


RUNTIME = Runtime("ik_llama.cpp", (IK,), (CPU,), _can_run, _start, batches=True,
                  pooled_cache=True)
