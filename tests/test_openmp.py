"""How long OpenMP threads spin (`core/openmp.py`): set while torch loads libgomp, which reads
it then (the children's: `test_child_process.py`); a user's own setting kept; the environment
that processes started from here inherit (a peer's llama-server) left as given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from adaspec.core import openmp
from adaspec.core.openmp import SPIN, spin_settings

FAKE_TORCH = """import os
SEEN = os.environ.get("GOMP_SPINCOUNT")
"""
PROBE = """import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("openmp", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
mod.load_torch()
import torch
print(json.dumps({"seen": torch.SEEN, "after": os.environ.get("GOMP_SPINCOUNT")}))
"""


def _load_with_fake_torch(tmp_path: Path, env: dict[str, str]) -> dict:
    """`load_torch` in a fresh interpreter whose torch records the spin count it saw."""
    (tmp_path / "torch").mkdir(exist_ok=True)
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    env = {**env, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", PROBE, openmp.__file__], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_torch_loads_with_the_short_spin_and_the_environment_stays_as_given(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in openmp.USER_SET}
    got = _load_with_fake_torch(tmp_path, env)
    assert got == {"seen": SPIN["GOMP_SPINCOUNT"], "after": None}


def test_a_users_own_setting_is_kept(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in openmp.USER_SET}
    got = _load_with_fake_torch(tmp_path, {**env, "OMP_WAIT_POLICY": "active"})
    assert got == {"seen": None, "after": None}  # nothing of ours added
    got = _load_with_fake_torch(tmp_path, {**env, "GOMP_SPINCOUNT": "77"})
    assert got == {"seen": "77", "after": "77"}
    assert spin_settings({"OMP_WAIT_POLICY": "passive"}) == {}
