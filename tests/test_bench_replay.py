"""`adaspec bench --replay`: recorded steps re-priced under another cost profile."""

from __future__ import annotations

import json

import pytest

from adaspec.cli import main
from adaspec.cost.profile import CostProfile, Curve
from adaspec.errors import InputError
from adaspec.lab.bench.replay import price_row, replay, write_replay


def _row(method: str, steps: list[list[int]], target_calls: int, draft_calls: int = 0,
         category: str = "code", new_tokens: int = 21) -> dict:
    return {
        "method": method, "category": category, "prompt_id": "p", "repeat": 0,
        "steps": steps, "target_calls": target_calls, "draft_calls": draft_calls,
        "new_tokens": new_tokens, "prompt_tokens": 100, "turn_tokens": [new_tokens],
        "drafted": sum(d for d, _ in steps), "wall_time": 1.0, "prefill_time": 0.2,
    }


def _profile(per_token: float) -> CostProfile:
    sizes = list(range(1, 17))
    return CostProfile(
        target=Curve(sizes, [0], [[10.0 + per_token * (n - 1) for n in sizes]]),
        draft=Curve([1], [0], [[2.0]]),
        overhead_ms=0.5,
        prefill_tokens_per_s=1000.0,
    )


@pytest.fixture
def results(tmp_path):
    rows = [
        _row("ar", [], target_calls=21),
        # 5 steps of 4 drafted tokens, all accepted: 20 tokens in 5 verifications
        _row("draft:k=4", [[4, 4]] * 5, target_calls=6, draft_calls=20),
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_a_row_is_priced_step_by_step(results):
    profile = _profile(per_token=5.0)
    ar = price_row(_row("ar", [], target_calls=21), profile)
    assert ar["decode_ms"] == pytest.approx(20 * (10.0 + 0.5))
    assert ar["prefill_ms"] == pytest.approx(100.0)
    spec = price_row(_row("d", [[4, 4]] * 5, target_calls=6, draft_calls=20), profile)
    assert spec["decode_ms"] == pytest.approx(5 * (10.0 + 4 * 5.0 + 0.5) + 20 * 2.0)


def test_head_steps_are_priced_at_the_head_ms_given():
    profile = _profile(per_token=5.0)
    row = {**_row("head:k=1", [[1, 1]] * 4, target_calls=17), "head_calls": 6}
    with pytest.raises(InputError, match="--head-ms"):
        price_row(row, profile)
    priced = price_row(row, profile, head_ms=0.25)
    plain = 17 - 1 - 4  # single-token steps: every call after the prompt's but the 4 drafts'
    assert priced["decode_ms"] == pytest.approx(4 * (10.0 + 5.0 + 0.5) + plain * 10.5
                                                + 6 * 0.25)


def test_flat_verification_makes_the_same_steps_pay_more(results):
    steep = replay(results, _profile(per_token=10.0), "steep")
    flat = replay(results, _profile(per_token=0.1), "flat")
    assert steep["simulated"] and flat["simulated"]
    s = steep["methods"]["draft:k=4"]["all"]["simulated_speedup"]
    f = flat["methods"]["draft:k=4"]["all"]["simulated_speedup"]
    assert f > s
    assert f == pytest.approx((20 * 10.5) / (5 * (10.0 + 0.4 + 0.5) + 40.0))


def test_replay_is_labelled_simulated_everywhere(results, capsys):
    """Under a simulated profile the figures say SIMULATED; under a measured one (a GPU's,
    from experiments/gpu_costs.py) PREDICTED, with where it was measured: never measured."""
    measured = _profile(0.1)
    measured.key = {"device": "NVIDIA H200"}
    _, md = write_replay(results, measured, "gpu_profile.json")
    assert md.startswith("# PREDICTED from the measured cost profile `gpu_profile.json` "
                         "(NVIDIA H200): recorded runs re-priced, not run there")
    simulated = _profile(0.1)
    simulated.simulated = True
    path, md = write_replay(results, simulated, "flat")
    assert md.startswith("# SIMULATED")
    assert json.loads(path.with_suffix(".json").read_text())["simulated"] is True
    code = main(["bench", "--replay", str(results), "--profile", "flat"])
    assert code == 0
    assert "SIMULATED" in capsys.readouterr().out
    assert (results / "replay-flat.md").is_file()


def test_replay_errors_name_the_problem(tmp_path, capsys):
    with pytest.raises(InputError, match="no bench results"):
        replay(tmp_path, _profile(1.0), "x")
    (tmp_path / "results.jsonl").write_text(json.dumps(_row("draft:k=4", [[4, 4]], 2, 4))
                                            + "\n")
    with pytest.raises(InputError, match="no `ar` rows"):
        replay(tmp_path, _profile(1.0), "x")
    assert main(["bench", "--replay", str(tmp_path)]) == 2
    assert "needs --profile" in capsys.readouterr().err
