"""How long OpenMP threads busy-wait after a parallel region, in each process adaspec runs.

libgomp's threads spin 300,000 times after each parallel region before they sleep, on cores
that another process of the same request needs next: the target and the draft in two
children (a target forward right after a draft forward took 43.5 ms against 37.5 after a
target forward, 2-vCPU EPYC), or torch in this process and the target's child (a draft-head
step made the target's next call 7.6-9.1 ms slower, 13%, 2-vCPU Xeon with AMX:
`experiments/head_pollution.py`). With 10,000 spins (3,000 to 100,000 alike) both are gone and
a process's own forwards are no slower; OMP_WAIT_POLICY=passive slows every ik_llama.cpp
forward by a third. A user's own setting of either variable is kept as given.

Imports nothing: `adaspec/__init__.py` applies it before torch loads libgomp, which reads it
once, then.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SPIN = {"GOMP_SPINCOUNT": "10000"}
USER_SET = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # either one, and we set nothing


def spin_settings(env: Mapping[str, str]) -> dict[str, str]:
    """What to add to `env` (nothing where the user set how OpenMP threads wait)."""
    return {} if any(name in env for name in USER_SET) else dict(SPIN)


def load_torch() -> None:
    """Import torch with the spin count set while libgomp reads it, and the environment as
    it was afterwards (a peer's llama-server started from this process runs stock)."""
    import sys

    added = spin_settings(os.environ) if "torch" not in sys.modules else {}
    os.environ.update(added)
    try:
        import torch  # noqa: F401
    finally:
        for name in added:
            os.environ.pop(name, None)
