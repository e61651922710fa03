"""One registry of runtimes: the weights variants each runs, the devices it runs on, whether
it can run a model here, and how it starts loading one.

`fastest` weights are the first registered runtime that runs on the device and can run the
model and that `fastest` may pick on that device. On a CPU the order is the measured speed
order (docs/cost-profile.md): ik_llama.cpp, then llama.cpp, then torch; on a GPU only torch
runs, and the static-cache runtime goes first. A new runtime is a package of its own under
`backends/` whose `runtime.py` defines a `Runtime` (`backends/base.py`), plus its line in
`BUILTIN`.
"""

from __future__ import annotations

from adaspec.backends.base import Runtime
from adaspec.backends.device import CPU
from adaspec.errors import InputError
from adaspec.registry import Registry, register_builtin

# "module:attribute" of each built-in Runtime, in the order `fastest` tries them
BUILTIN = (
    "adaspec.backends.ik.runtime:RUNTIME",
    "adaspec.backends.llamacpp.runtime:RUNTIME",
    "adaspec.backends.torch.runtime:STATIC_RUNTIME",
    "adaspec.backends.torch.runtime:TORCH",
    "adaspec.backends.torch.runtime:QUANTIZED",
)


RUNTIMES: Registry[Runtime] = Registry(
    "runtime", loader=lambda: register_builtin(RUNTIMES, BUILTIN))


def runtime_for(weights: str, device: str) -> Runtime:
    """The runtime that runs `weights` on `device`; InputError naming what does run there."""
    for _, runtime in RUNTIMES.items():
        if weights in runtime.weights and device in runtime.devices:
            return runtime
    there = [w for _, r in RUNTIMES.items() if device in r.devices for w in r.weights]
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
    for _, runtime in RUNTIMES.items():
        if (device in runtime.devices and device in (runtime.fastest_on or runtime.devices)
                and runtime.can_run(name)):
            return runtime.weights[0]
    raise InputError(f"no runtime here runs {name!r} on {device}")
