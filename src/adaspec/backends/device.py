"""Where a model runs (`--device auto|cpu|cuda`): the CPU runtimes (ik_llama.cpp, llama.cpp,
torch) or torch on a CUDA GPU. `auto` is the GPU when torch sees one, else the CPU; `cuda`
without a GPU is a one-line error naming what is missing."""

from __future__ import annotations

from adaspec.errors import InputError

AUTO, CPU, CUDA = "auto", "cpu", "cuda"
DEVICES = (AUTO, CPU, CUDA)


def cuda_missing() -> str | None:
    """Why torch cannot use a CUDA GPU here, or None when it can."""
    import torch

    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU-only build"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    return None


def resolve_device(device: str) -> str:
    """`cpu` or `cuda` for a --device value; InputError for an unknown one or for `cuda`
    where no GPU can be used."""
    if device not in DEVICES:
        raise InputError(f"unknown device {device!r}; use one of {', '.join(DEVICES)}")
    if device == AUTO:
        return CPU if cuda_missing() else CUDA
    if device == CUDA:
        why = cuda_missing()
        if why:
            raise InputError(f"--device cuda: no CUDA GPU ({why}); use --device cpu")
    return device


def device_name(device: str) -> str:
    """What a cost profile's key says of a device: the GPU's model for `cuda`."""
    if device == CUDA:
        import torch

        return f"cuda:{torch.cuda.get_device_name(0)}"
    return device
