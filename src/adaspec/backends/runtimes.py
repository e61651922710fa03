"""One registry of runtimes: the weights variants each runs, the devices it runs on, whether
it can run a model here, and how it starts loading one.

`fastest` weights are the first registered runtime that runs on the device and can run the
model and that `fastest` may pick on that device. On a CPU the order is the measured speed
order (docs/cost-profile.md): ik_llama.cpp, then llama.cpp, then torch; on a GPU only torch
runs, and the static-cache runtime goes first. A new runtime is a module of its own plus one
`register` call at the end of this file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adaspec.backends.base import ModelBackend
from adaspec.backends.device import CPU, CUDA
from adaspec.errors import InputError

COMPILE_ENV = "ADASPEC_TORCH_COMPILE"  # 1: the static runtime compiles its fixed passes

Loaded = tuple[ModelBackend, object, list[int]]  # backend, tokenizer (or None), EOS ids


@dataclass(frozen=True)
class LoadRequest:
    """One model to load, as `backends/load.start_backend` was asked for it."""

    name: str
    dtype: str
    weights: str  # a concrete variant (never `fastest`)
    role: str  # "target" | "draft"
    device: str  # a resolved device: cpu | cuda
    tokenizer_like: str | None = None  # another model whose tokenizer files may be the same
    sequences: int = 1  # sequences a multi-sequence runtime holds


@dataclass(frozen=True)
class Runtime:
    name: str
    weights: tuple[str, ...]  # the weights variants it runs
    devices: tuple[str, ...]
    can_run: Callable[[str], bool]  # whether it is installed and can read model `name`
    start: Callable[[LoadRequest], Callable[[], Loaded]]  # starts loading; returns `finish`
    fastest_on: tuple[str, ...] | None = None  # devices `fastest` may pick it on (all)
    batches: bool = False  # decodes several sequences in one call (`serve --max-batch`)
    # its sequences share one pool of KV cells: an idle sequence costs nothing until its
    # cells are needed (ik_llama.cpp; the static runtime preallocates and computes every row)
    pooled_cache: bool = False


RUNTIMES: list[Runtime] = []


def register(runtime: Runtime) -> None:
    if any(r.name == runtime.name for r in RUNTIMES):
        raise ValueError(f"runtime {runtime.name!r} is already registered")
    RUNTIMES.append(runtime)


def runtime_for(weights: str, device: str) -> Runtime:
    """The runtime that runs `weights` on `device`; InputError naming what does run there."""
    for runtime in RUNTIMES:
        if weights in runtime.weights and device in runtime.devices:
            return runtime
    there = [w for r in RUNTIMES if device in r.devices for w in r.weights]
    raise InputError(f"--weights {weights} does not run on --device {device}; there: "
                     f"{', '.join(there)}" + (" (or --device cpu)" if device != CPU else ""))


def batches(weights: str, device: str) -> bool:
    """Whether the runtime of `weights` on `device` decodes several requests in one call."""
    return runtime_for(weights, device).batches


def pools_cache(weights: str, device: str) -> bool:
    """Whether the runtime of `weights` on `device` keeps its sequences in one pool of KV
    cells (idle sequences free until their cells are needed)."""
    return runtime_for(weights, device).pooled_cache


def fastest_weights(name: str, device: str = CPU) -> str:
    """The weights variant `fastest` stands for: model `name` on `device`."""
    for runtime in RUNTIMES:
        if (device in runtime.devices and device in (runtime.fastest_on or runtime.devices)
                and runtime.can_run(name)):
            return runtime.weights[0]
    raise InputError(f"no runtime here runs {name!r} on {device}")


# ---------------------------------------------------------------------- the runtimes
def _start_gguf_child(req: LoadRequest) -> Callable[[], Loaded]:
    """The model's GGUF by ik_llama.cpp / llama.cpp in a child process of its own, started
    now so several load at once: beside torch in one process the two thread pools slow each
    other down about 2x, and a native abort in the child is a one-line error. The tokenizer
    still comes from the verified cache."""
    from adaspec.backends.ikllama import IK, IkLlamaBackend, context_for, target_min_rows
    from adaspec.backends.llamacpp import LlamaCppBackend, gguf_backend_args
    from adaspec.backends.load import eos_ids_of
    from adaspec.backends.process_backend import ProcessBackend
    from adaspec.backends.weights import llama_threads
    from adaspec.store.loading import same_vocabulary_files, tokenizer_dir
    from adaspec.store.model_store import load_tokenizer

    # fails fast (package missing, no GGUF), before a child process starts
    args: tuple[Any, ...] = gguf_backend_args(req.name, llama_threads(), runtime=req.weights)
    if req.weights == IK:  # repacked; a target's blocks decided at load (exact greedy)
        args = (*gguf_backend_args(req.name, llama_threads(), context_for(req.sequences), IK),
                True, target_min_rows() if req.role == "target" else 1, req.sequences)
    backend = ProcessBackend(IkLlamaBackend if req.weights == IK else LlamaCppBackend, *args,
                             wait=False)

    def finish() -> Loaded:
        try:
            tokenizer = None
            if req.tokenizer_like is None or not same_vocabulary_files(
                tokenizer_dir(req.name, req.dtype), tokenizer_dir(req.tokenizer_like, req.dtype)
            ):
                tokenizer = load_tokenizer(req.name, req.dtype)
            backend.ready()
        except BaseException:
            backend.close()
            raise
        return backend, tokenizer, eos_ids_of(None, tokenizer) if tokenizer else []

    return finish


def _start_torch(req: LoadRequest) -> Callable[[], Loaded]:
    from adaspec.backends.load import load_torch_backend

    return lambda: load_torch_backend(req.name, req.dtype, req.weights, req.role, req.device)


def _start_static(req: LoadRequest) -> Callable[[], Loaded]:
    def finish() -> Loaded:
        from adaspec.backends.load import eos_ids_of
        from adaspec.backends.static_torch import static_backend
        from adaspec.store.model_store import load_model

        loaded = load_model(req.name, dtype=req.dtype, quant="none")
        compile = os.environ.get(COMPILE_ENV, "").strip() not in ("", "0")
        backend = static_backend(loaded.model, loaded.name, req.device, compile=compile)
        return backend, loaded.tokenizer, eos_ids_of(loaded.model, loaded.tokenizer)

    return finish


def _has_gguf(name: str) -> bool:
    from adaspec.backends.weights import has_gguf

    return has_gguf(name)


def _ik_can_run(name: str) -> bool:
    from adaspec.backends.ikllama import available

    return _has_gguf(name) and available()


def _llamacpp_can_run(name: str) -> bool:
    from adaspec.backends.weights import llama_cpp_installed

    return _has_gguf(name) and llama_cpp_installed()


def _always(name: str) -> bool:
    return True


def _quant_modes() -> tuple[str, ...]:
    from adaspec.store.quant import QUANT_MODES

    return tuple(q for q in QUANT_MODES if q != "none")


register(Runtime("ik_llama.cpp", ("ik",), (CPU,), _ik_can_run, _start_gguf_child,
                 batches=True, pooled_cache=True))
register(Runtime("llama.cpp", ("gguf",), (CPU,), _llamacpp_can_run, _start_gguf_child))
register(Runtime("torch-static", ("static",), (CPU, CUDA), _always, _start_static,
                 fastest_on=(CUDA,), batches=True))
register(Runtime("torch", ("none",), (CPU, CUDA), _always, _start_torch))
register(Runtime("torch-quantized", _quant_modes(), (CPU,), _always, _start_torch))
