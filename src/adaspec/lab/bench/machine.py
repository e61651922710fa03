"""The machine a benchmark ran on, and its measured memory bandwidth.

Decoding one token streams every weight of the model from memory once, so tokens/s is
bounded by bandwidth / weight bytes. Two microbenchmarks, best of several runs each:

- copy: `dst.copy_(src)` of a large float32 tensor; bytes read + bytes written per second;
- gemv: a matrix-vector product in the model's dtype (the decode-time access pattern);
  matrix bytes read per second.
"""

from __future__ import annotations

import os
import platform
import time

import torch

from adaspec.store.native_build import cpu_flags as linux_flags
from adaspec.store.native_build import cpu_model


def _best_seconds(fn, repeats: int, device: str = "cpu") -> float:
    def drained() -> None:  # a GPU's work is asynchronous: time it to its end
        fn()
        if device != "cpu":
            torch.cuda.synchronize()

    drained()  # touch the pages / warm the kernels
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        drained()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def measure_bandwidth(
    megabytes: int = 256, dtype: torch.dtype = torch.bfloat16, repeats: int = 5,
    device: str = "cpu",
) -> dict:
    """GB/s of a large copy and of a GEMV over a `megabytes`-sized matrix, in `device`'s
    memory (a GPU's own for `cuda`: what its passes' weight reads are held against)."""
    from adaspec.cost.measure import copy_bandwidth_gbs

    copy_gbs = copy_bandwidth_gbs(megabytes, repeats, device)
    elem = torch.empty((), dtype=dtype).element_size()
    cols = 4096
    rows = megabytes * (1 << 20) // (cols * elem)
    w = torch.randn(rows, cols, device=device).to(dtype)
    x = torch.randn(cols, device=device).to(dtype)
    gemv_s = _best_seconds(lambda: torch.mv(w, x), repeats, device)
    gemv_gbs = w.numel() * elem / gemv_s / 1e9
    return {
        "copy_gbs": round(copy_gbs, 2),
        "gemv_gbs": round(gemv_gbs, 2),
        "gemv_dtype": str(dtype).replace("torch.", ""),
        "megabytes": megabytes,
        "device": device,
        "method": (
            f"best of {repeats}: float32 tensor copy of {megabytes} MiB (read + write bytes / s); "
            f"{str(dtype).replace('torch.', '')} GEMV over a {megabytes} MiB [{rows}x{cols}] "
            "matrix (matrix bytes / s)"
        ),
    }


# Instruction-set extensions that decide which kernels are fast (bf16 GEMM, int8 GEMM, AMX).
_ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    """The kernel-relevant ISA extensions this CPU reports: results from a machine without
    avx512_bf16 (bf16 emulated) or VNNI (no fast int8 GEMM) are not comparable with one that
    has them."""
    have = linux_flags()
    return [flag for flag in _ISA_FLAGS if flag in have]


def memory_gb() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1e6, 1)
    except OSError:
        pass
    return None


def describe_machine(device: str = "cpu") -> dict:
    """The host, and the GPU where the run is on one."""
    import transformers

    gpu = {"gpu": torch.cuda.get_device_name(0)} if device.startswith("cuda") else {}
    return {**gpu,
        "cpu": cpu_model(),
        "isa": " ".join(cpu_flags()),
        "cores": os.cpu_count(),
        "memory_gb": memory_gb(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }
