"""The prepared GPU script (experiments/gpu_session.sh, issue 68) on the CPU: its costs part on
tiny shapes runs to the end and writes every summary the device call brings back, so a typo
never costs device time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_gpu_sessions_costs_part_runs_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = subprocess.run(["bash", "experiments/gpu_session.sh", "costs-dry"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "torch" in (tmp_path / "machine.txt").read_text()
    record = json.loads((tmp_path / "costs" / "gpu_costs.json").read_text())
    target, draft = record["models"].values()
    for row in (target, draft):
        assert set(row["static_ms"]) == {"1", "2", "4", "8", "16", "32", "64"}
        assert row["floor_ms"] > 0 and row["loop"]["target_ms_per_step"] > 0
        assert set(row["batch_ms"]) == {"1", "2", "4", "8"}
    assert target["head_step"]["eager_ms"] > 0 and target["head_over_step"] > 0
    assert set(target["sweep"]) == {"1", "4"}
    assert all(v["adaspec_tok_s"] > 0 and v["hf_generate_tok_s"] > 0
               for v in target["sweep"].values())
    profile = json.loads((tmp_path / "costs" / "gpu_profile.json").read_text())
    assert profile["key"]["note"].startswith("random-init")
    batch = json.loads((tmp_path / "costs" / "gpu_batch_cost.json").read_text())
    assert batch["curve"]["contexts"] == [1, 2, 4, 8]  # sequences, tiny: up to 8
    summary = (tmp_path / "costs" / "gpu_costs.md").read_text()
    assert "The draft head" in summary and "| 4 |" in summary


def test_the_gpu_benchs_methods_all_parse():
    """Every method the device call's bench runs is a valid method string (its `hf*` peers
    are the bench's own), checked here rather than on the GPU."""
    sys.path.insert(0, str(REPO / "experiments"))
    try:
        import gpu_bench
    finally:
        sys.path.remove(str(REPO / "experiments"))
    from adaspec.methods.spec import parse_method, split_method_list

    methods = split_method_list(gpu_bench.METHODS)
    assert "auto:tree=priced" in methods and "head:tree=priced" in methods
    for text in methods:
        if not text.startswith("hf"):
            parse_method(text)
