"""A cost measured while other processes kept the machine busy (`cost/other_load.py`): the
share they took is counted, stored beside the cost, and a later run on a quiet machine
measures it again; a machine that is still busy keeps it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from adaspec.cost import other_load
from adaspec.cost.profile import CostProfile

from .conftest import tiny_model
from .cost_helpers import steep

TICK = os.sysconf("SC_CLK_TCK")
CPUS = os.cpu_count() or 1


def test_the_share_is_other_processes_time_over_the_machines():
    start = (100.0, 1_000, 400)
    # 10 s: the machine busy 0.75 of its capacity, this tree 0.25 of it: others 0.5
    end = (110.0, 1_000 + int(0.75 * 10 * TICK * CPUS), 400 + int(0.25 * 10 * TICK * CPUS))
    assert other_load.share_between(start, end) == pytest.approx(0.5, abs=0.01)
    only_mine = (110.0, end[1], end[1] - start[1] + start[2])
    assert other_load.share_between(start, only_mine) == 0.0
    assert other_load.share_between(start, (100.5, end[1], end[2])) == 0.0  # too short
    assert other_load.share_between(None, end) == 0.0  # no /proc


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_child_process_counts_as_this_processs_own():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        processes = other_load._processes()
        mine = other_load.tree(os.getpid(), processes)
        assert child.pid in mine and os.getpid() in mine
        assert os.getppid() not in mine  # the parent (pytest's controller, a shell) is not
    finally:
        child.kill()
        child.wait()
    own = processes[os.getpid()][1]
    assert other_load._tree_ticks(os.getpid()) >= own > 0  # this process has run
    assert other_load._machine_busy_ticks() >= own


@pytest.fixture
def machine(monkeypatch):
    """Other processes' share while something is measured (`during`) and while a run
    probes the machine at start (`now`)."""
    state = {"during": 0.0, "now": 0.0}

    class Load:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.share = state["during"]

    monkeypatch.setattr(other_load, "OtherLoad", Load)
    monkeypatch.setattr(other_load, "others_now", lambda seconds=1.0: state["now"])
    return state


@pytest.fixture
def backends(tmp_path, monkeypatch):
    from adaspec.backends.torch.backend import TorchBackend

    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    return TorchBackend(tiny_model()), TorchBackend(tiny_model(seed=1, layers=1))


def test_a_profile_measured_under_load_is_measured_again_once_the_machine_is_quiet(
        backends, machine, monkeypatch, capsys):
    import adaspec.cost.measure as measure
    from adaspec.cost.cache import cached_profile, profile_for, profile_key

    measured: list[CostProfile] = []

    def fake_measure(*args, key, **kwargs) -> CostProfile:
        measured.append(steep())
        measured[-1].key = key  # what it was measured on, as measure_profile records
        return measured[-1]

    monkeypatch.setattr(measure, "measure_profile", fake_measure)
    target, draft = backends

    def run() -> CostProfile:
        return profile_for(target, draft, quiet=True, loop_overhead=lambda *a, **k: 0.0)

    machine["during"] = 0.6  # a build beside the first run
    first = run()
    assert first.others_share == 0.6 and len(measured) == 1
    assert "took 60% of this machine's CPU" in capsys.readouterr().err
    assert cached_profile(profile_key(target, draft)).others_share == 0.6  # stored, marked
    machine["now"] = 0.5  # still busy: the stored one prices this machine as it is
    assert run().others_share == 0.6 and len(measured) == 1
    machine.update(now=0.0, during=0.05)  # quiet now: measured again, and kept
    assert run().others_share == 0.05 and len(measured) == 2
    assert "took" not in capsys.readouterr().err
    machine["now"] = 0.0
    run()
    assert len(measured) == 2  # a quiet measurement is read back


def test_a_batch_cost_measured_under_load_is_measured_again_once_quiet(backends, machine,
                                                                       monkeypatch):
    import adaspec.cost.batch as cb
    from adaspec.cost.profile import Curve

    calls: list[int] = []

    def fake_measure(views, key, progress=None):
        calls.append(len(views))
        return cb.BatchCost(Curve([1, 64], [1, 2], [[11.0, 74.0], [21.0, 84.0]]), key)

    monkeypatch.setattr(cb, "measure_batch_cost", fake_measure)
    target = backends[0]
    views = [target] * 2
    machine["during"] = 0.4
    assert cb.batch_cost_for(target, views).others_share == 0.4
    machine["now"] = 0.3  # still busy: kept
    cb.batch_cost_for(target, views)
    assert len(calls) == 1
    machine.update(now=0.1, during=0.0)  # quiet: measured again
    assert cb.batch_cost_for(target, views).others_share == 0.0 and len(calls) == 2
    cb.batch_cost_for(target, views)
    assert len(calls) == 2
