"""The router's `profile` cost: each arm's decode priced by a cost profile from what the arm
did on the prompt (recorded steps, draft forwards, draft prefill), instead of the parameter
count; a cheap arm ranks above a dear one exactly as the profile says."""

from __future__ import annotations

import numpy as np
import pytest

from adaspec.core.token_tree import PricedBranching
from adaspec.cost.profile import CostProfile, Curve
from adaspec.errors import InputError
from adaspec.lab.router.collection import RouterData
from adaspec.lab.router.evaluate import proxy_vs_truth
from adaspec.lab.router.reward import priced_decode_ms, rewards
from adaspec.lab.router.train_policy import data_rewards, train_artifact
from adaspec.route.artifact import load_artifact
from adaspec.route.policy import TrainConfig
from tests.cost_helpers import steep
from tests.route_helpers import make_collection
from tests.test_cli import home, run  # noqa: F401 (home: autouse fixture)


def flat() -> CostProfile:
    """A GPU: verification almost free, drafting cheap."""
    return CostProfile.from_formula("linear:target_ms=20,per_token_ms=0.1,draft_ms=1")


def row(method: str, steps, prompt: str = "p0", single: int = 0, draft_calls=None) -> dict:
    """A bench row: one turn, these (drafted, accepted) steps and `single` plain steps."""
    tokens = 1 + sum(a + 1 for _, a in steps) + single
    return {
        "prompt_id": prompt, "method": method, "category": "code", "repeat": 0,
        "steps": [list(s) for s in steps], "turn_tokens": [tokens], "new_tokens": tokens,
        "target_calls": 1 + len(steps) + single, "prompt_tokens": 20,
        "draft_calls": sum(d for d, _ in steps) if draft_calls is None else draft_calls,
        "wall_time": 1.0, "prefill_time": 0.1,
    }


def test_priced_decode_by_hand():
    profile = CostProfile(
        target=Curve([1, 9], [0], [[30.0, 110.0]]),  # 30 + 10 (n - 1)
        draft=Curve([1, 5], [0], [[5.0, 9.0]]),  # 5 + (n - 1)
        overhead_ms=1.0,
        draft_prefill_tokens_per_s=1000.0,
    )
    r = row("draft:k=4", [(4, 1), (4, 4)], single=1)
    # verifications of 5 tokens (70 ms) twice, one plain step (30), 3 passes of overhead,
    # 8 draft forwards of 5 ms, 20 prompt tokens prefilled by the draft at 1000 tokens/s
    assert priced_decode_ms(r, profile) == pytest.approx(2 * 70 + 30 + 3 + 8 * 5 + 20)
    # a 2x2x1 tree arm: a 3-level step verifies 2 + 4 + 4 = 10 nodes (+ root: 11 -> 130 ms),
    # a step cut to 1 level 2 nodes (50 ms); draft forwards of 1, 2, 4 tokens and of 1
    tree = row("draft:tree=2x2x1", [(3, 2), (1, 0)], draft_calls=4)
    assert priced_decode_ms(tree, profile, (2, 2, 1)) == pytest.approx(
        130 + 50 + 2 * 1 + (5 + 6 + 8) + 5 + 20
    )
    plain = row("ar", [], single=5)
    assert priced_decode_ms(plain, profile) == pytest.approx(5 * 31)  # no draft, no prefill
    with pytest.raises(InputError, match="tree=priced"):
        priced_decode_ms(tree, profile, PricedBranching())
    with pytest.raises(InputError, match="no draft model"):
        priced_decode_ms(r, CostProfile(target=Curve([1], [0], [[30.0]])))


def table(measured: list[float]) -> RouterData:
    """Two prompts, three arms: plain decoding, a long draft and a short one, 12 tokens
    each after the prefill's. Measured times as given (the same for both prompts)."""
    arms = ["ar", "draft:k=8", "draft:k=2"]
    runs = {
        "ar": row("ar", [], single=12),
        "draft:k=8": row("draft:k=8", [(8, 5)] * 2),  # 6 tokens per step, 8 drafted
        "draft:k=2": row("draft:k=2", [(2, 2)] * 4),  # 3 tokens per step, 2 drafted
    }
    prompts = ["p0", "p1"]
    rows = {(p, a): {**runs[a], "prompt_id": p} for p in prompts for a in arms}
    ms = np.array([measured, measured])
    return RouterData(
        arms=arms, methods={a: a for a in arms}, prompt_ids=prompts, categories=["c", "c"],
        states=np.zeros((2, 4), dtype=np.float32), similarity=np.ones((2, 3)),
        ms_per_token=ms, decode_ms_per_token=ms, ar_ms_per_token=ms[:, 0],
        params=[1_500_000_000, 500_000_000, 500_000_000], target="t", rows=rows,
    )


@pytest.mark.parametrize("name, profile", [("steep", steep()), ("flat", flat())])
def test_profile_cost_ranks_arms_as_the_profile_says(name, profile):
    # measured times that say the opposite of each profile, so only the profile can decide
    data = table([40.0, 20.0, 30.0] if name == "steep" else [40.0, 30.0, 20.0])
    priced = data.with_profile(profile)
    expected = np.array([
        priced_decode_ms(data.rows[("p0", a)], profile) / data.rows[("p0", a)]["new_tokens"]
        for a in data.arms
    ])
    assert priced.profile_ms_per_token[0] == pytest.approx(expected)
    r = data_rewards(priced, alpha=0.0, cost="profile")
    assert r[0] == pytest.approx(expected.min() / expected)  # t_best / t_arm
    cheap = data.arms[int(np.argmax(r[0]))]
    assert cheap == ("draft:k=2" if name == "steep" else "draft:k=8")
    # ... where the measured reward follows the timings and the parameter count cannot
    # tell two arms on the same draft apart
    assert data.arms[int(np.argmax(data_rewards(data, 0.0, "measured")[0]))] != cheap
    params = data_rewards(data, 0.0, "params")[0]
    assert params[1] == params[2]
    assert priced.subset([1]).profile_ms_per_token[0] == pytest.approx(expected)
    assert "profile" in proxy_vs_truth(priced, 0.0) and "profile" not in proxy_vs_truth(data, 0.0)


def test_profile_cost_needs_priced_data():
    data = table([40.0, 20.0, 30.0])
    assert data.costs == ["measured", "params"]
    with pytest.raises(InputError, match="--profile"):
        data_rewards(data, 0.5, "profile")
    priced = data.with_profile(steep())
    assert priced.costs == ["measured", "params", "profile"]
    art = train_artifact(priced, 0.1, "profile", TrainConfig(epochs=2, hidden=8))
    assert art.cost == "profile" and art.info["profile"].endswith("(simulated)")
    # rewards() itself reads the ms it is given the same way for both time-based costs
    sim, ms = np.ones((1, 2)), np.array([[10.0, 20.0]])
    assert rewards(sim, ms, [1, 1], 0.0, "profile").tolist() == [[1.0, 0.5]]


def test_router_train_with_a_profile(capsys, tmp_path):
    data = make_collection(tmp_path / "data", max_new_tokens=6)
    out = tmp_path / "router.pt"
    code, text, err = run(capsys, "router", "train", str(data), "--out", str(out), "--epochs",
                          "2", "--hidden", "16", "--profile", "flat")
    assert code == 0, err
    assert "cost profile (formula:" in text
    art = load_artifact(out)
    assert art.cost == "profile" and "simulated" in art.info["profile"]
    code, _, err = run(capsys, "router", "train", str(data), "--out", str(out), "--cost",
                       "profile")
    assert code == 2 and "--profile" in err
    code, text, err = run(capsys, "router", "cv", str(data), "--folds", "2", "--alphas", "0",
                          "--epochs", "2", "--hidden", "16", "--profile", "flat")
    assert code == 0 and "cost profile" in text, err
