"""The torch runtimes' registrations (`backends/runtimes.py`): the static-cache runtime
(`static.py`, first on a GPU), torch in the model's dtype, and torch with a weight
quantization (`store/quant.py`)."""

from __future__ import annotations

import os
from collections.abc import Callable

from adaspec.backends.base import Loaded, LoadRequest, Runtime, eos_ids_of
from adaspec.backends.device import CPU, CUDA
from adaspec.backends.weights import STATIC

COMPILE_ENV = "ADASPEC_TORCH_COMPILE"  # 1: the static runtime compiles its fixed passes


def load_torch_backend(name: str, dtype: str, quant: str, role: str,
                       device: str = CPU) -> Loaded:
    """A torch model with weight quantization `quant` (store/quant.py). A quantized target
    on the CPU (row-independent Linear layers) gets row-invariant attention, so verifying a
    block scores bit for bit what plain decoding scores; a float target's batched GEMMs are
    not row-invariant anyway, so it keeps the faster batched attention (and the exactness
    check's tie rule), as does every draft and a model with sliding-window layers."""
    from adaspec.backends.torch.attention import row_invariance_supported
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.store.model_store import load_model

    loaded = load_model(name, dtype=dtype, quant=quant)
    invariant = (device == CPU and role == "target" and loaded.quant != "none"
                 and row_invariance_supported(loaded.model))
    backend = TorchBackend(loaded.model.to(device), name=loaded.name, row_invariant=invariant)
    return backend, loaded.tokenizer, eos_ids_of(loaded.model, loaded.tokenizer)


def _start_torch(req: LoadRequest) -> Callable[[], Loaded]:
    return lambda: load_torch_backend(req.name, req.dtype, req.weights, req.role, req.device)


def _start_static(req: LoadRequest) -> Callable[[], Loaded]:
    def finish() -> Loaded:
        from adaspec.backends.torch.static import static_backend
        from adaspec.store.model_store import load_model

        loaded = load_model(req.name, dtype=req.dtype, quant="none")
        compile = os.environ.get(COMPILE_ENV, "").strip() not in ("", "0")
        backend = static_backend(loaded.model, loaded.name, req.device, compile=compile)
        return backend, loaded.tokenizer, eos_ids_of(loaded.model, loaded.tokenizer)

    return finish


def _always(name: str) -> bool:
    return True


def _quant_modes() -> tuple[str, ...]:
    from adaspec.store.quant import QUANT_MODES

    return tuple(q for q in QUANT_MODES if q != "none")


STATIC_RUNTIME = Runtime("torch-static", (STATIC,), (CPU, CUDA), _always, _start_static,
                         fastest_on=(CUDA,), batches=True)
TORCH = Runtime("torch", ("none",), (CPU, CUDA), _always, _start_torch)
QUANTIZED = Runtime("torch-quantized", _quant_modes(), (CPU,), _always, _start_torch)
