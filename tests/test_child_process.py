"""An object served by a child process: its methods answer across the socket, and a failed
build, a failed call or a dead child is a one-line error of the caller's chosen class, never
a traceback or a hang; and how long OpenMP threads spin, in the children and in this process
(`core/openmp.py`: set while torch loads libgomp, the environment left as given)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adaspec.backends.child_process import ChildProcess, ChildProcessFailed
from adaspec.core import openmp
from adaspec.core.openmp import SPIN, spin_settings
from adaspec.errors import AdaspecError


class Refused(AdaspecError):
    pass


def test_calls_run_on_the_object_in_the_child():
    child = ChildProcess(list, [3, 1, 2])
    try:
        assert child.call("index", 2) == 2
        child.call("sort")
        assert child.call("copy") == [1, 2, 3]
        assert child._proc.pid != __import__("os").getpid()
    finally:
        child.close()
    assert child._proc.poll() is not None  # the child is gone


def test_a_failed_build_or_call_is_one_line():
    with pytest.raises(ChildProcessFailed, match="failed while loading: ValueError: invalid"):
        ChildProcess(int, "not a number")
    child = ChildProcess(list, [1])
    with pytest.raises(ChildProcessFailed, match="failed while index: ValueError"):
        child.call("index", 99)
    assert child.call("copy") == [1]  # the child lives on after a failed call
    child.close()


def test_a_dead_child_raises_the_callers_error_class():
    child = ChildProcess(list, [1], error=Refused)
    child._proc.kill()
    with pytest.raises(Refused, match="died while copy"):
        child.call("copy")
    child.close()


def test_ctrl_c_is_left_to_the_parent():
    import signal

    child = ChildProcess(list, [1])
    child._proc.send_signal(signal.SIGINT)  # as a terminal's Ctrl-C reaches the process group
    assert child.call("copy") == [1]
    child.close()


def test_a_child_whose_parent_is_gone_exits_quietly(capfd):
    import importlib

    child = ChildProcess(importlib.import_module, "time")
    child._conn.send(("sleep", (0.5,)))  # a call in flight ...
    child._conn.close()  # ... when the parent goes away
    assert child._proc.wait(timeout=10) == 0
    assert "Traceback" not in capfd.readouterr().err


def _env_of_child(name: str):
    import os

    return os.environ.get(name)


class _EnvReader:
    def get(self, name: str):
        return _env_of_child(name)


def test_children_spin_briefly_unless_the_user_said_otherwise(monkeypatch):
    """OpenMP threads of one child must not busy-wait on the cores the other child's next
    forward needs: a child gets GOMP_SPINCOUNT=10000, unless the user set it or a wait
    policy."""
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.setenv(name, "x")  # recorded as it was, so teardown restores it
        monkeypatch.delenv(name)
    child = ChildProcess(_EnvReader)
    try:
        assert child.call("get", "GOMP_SPINCOUNT") == "10000"
    finally:
        child.close()
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    child = ChildProcess(_EnvReader)
    try:
        assert child.call("get", "GOMP_SPINCOUNT") is None
        assert child.call("get", "OMP_WAIT_POLICY") == "active"
    finally:
        child.close()


# ---------------------------------------------- this process's spin (core/openmp.py)
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
