"""Replaying routing decisions on measured runs: oracle, replay, learning curve, sweeps."""

from __future__ import annotations

import numpy as np
import pytest

from adaspec.errors import InputError
from adaspec.lab.router.collection import RouterData
from adaspec.lab.router.evaluate import (
    alpha_sweep,
    cross_validate,
    learning_curve,
    oracle_choices,
    policy_choices,
    proxy_vs_truth,
    replay_scopes,
    replay_speedup,
    routed_rows,
    speedups,
    timing_noise,
)
from adaspec.lab.router.train_policy import data_rewards, train_artifact
from adaspec.route.policy import TrainConfig


def synthetic(n: int = 12, seed: int = 0) -> RouterData:
    """Two kinds of prompts: ngram is 2x on 'sum' prompts, draft 1.5x on 'code' prompts."""
    rng = np.random.default_rng(seed)
    arms = ["ar", "ngram", "draft:k=4"]
    cats = ["sum" if i % 2 else "code" for i in range(n)]
    states = np.array([[1.0 if c == "sum" else -1.0, *rng.normal(0, 0.1, 3)] for c in cats])
    ms = np.array([[100.0, 50.0, 90.0] if c == "sum" else [100.0, 110.0, 66.7] for c in cats])
    rows = {}
    for i in range(n):
        pid = f"p{i}"
        for j, a in enumerate(arms):
            rows[(pid, a)] = {"prompt_id": pid, "category": cats[i], "method": a, "repeat": 0,
                              "new_tokens": 10, "wall_time": ms[i, j] / 100}
    return RouterData(
        arms=arms, methods={a: a for a in arms}, prompt_ids=[f"p{i}" for i in range(n)],
        categories=cats, states=states.astype(np.float32), similarity=np.ones((n, 3)),
        ms_per_token=ms, decode_ms_per_token=ms, ar_ms_per_token=ms[:, 0],
        params=[1500, 0, 500], target="t", rows=rows,
    )


def test_oracle_and_replayed_speedups():
    data = synthetic()
    picks = oracle_choices(data)
    assert [data.arms[i] for i in picks[:2]] == ["draft:k=4", "ngram"]
    table = speedups([*(data.rows[(p, "ar")] for p in data.prompt_ids),
                      *routed_rows(data, picks, "oracle")], ["oracle"])
    assert table["sum"]["oracle"] == pytest.approx(2.0)
    assert table["code"]["oracle"] == pytest.approx(1.5, rel=1e-3)
    assert table["mean over categories"]["oracle"] == pytest.approx(1.75, rel=1e-3)
    assert replay_speedup(data, np.zeros(len(data), dtype=int)) == pytest.approx(1.0)


def test_learning_curve_and_alpha_sweep_learn_the_split():
    train, test = synthetic(32, seed=1), synthetic(12, seed=2)
    cfg = TrainConfig(epochs=40, hidden=32)
    curve = learning_curve(train, test, [4, 32], alpha=0.0, cost="measured", config=cfg, draws=2)
    assert [p["prompts"] for p in curve] == [4, 32] and curve[0]["draws"] == 2
    assert curve[-1]["speedup"] > 1.6  # near the oracle's ~1.71 overall
    sweep = alpha_sweep(train, test, [0.0, 1.0], "measured", cfg)
    assert sweep[0]["speedup"] > 1.6 and set(sweep[0]["picks"]) == {"ngram", "draft:k=4"}


def test_cross_validation_routes_each_fold_by_a_policy_trained_on_the_others():
    train = synthetic(16, seed=3)
    cfg = TrainConfig(epochs=40, hidden=32)
    fast, slow = cross_validate(train, [0.0, 1.0], "measured", cfg, folds=4)
    oracle = replay_scopes(train, oracle_choices(train))
    # alpha 0: the measured reward separates the two kinds of prompts, on held-out folds too
    assert fast["fastest_share"] >= 14 / 16 and fast["speedup"] > 0.95 * oracle[0]
    assert set(fast["picks"]) == {"ngram", "draft:k=4"} and fast["folds"] == 4
    # alpha 1: similarity is 1 for every arm, nothing to learn
    assert slow["fastest_share"] < 1.0 and slow["speedup"] < fast["speedup"]
    with pytest.raises(InputError, match="folds"):
        cross_validate(train, [0.0], "measured", cfg, folds=17)


def test_proxy_vs_truth_reports_agreement():
    rep = proxy_vs_truth(synthetic(), alpha=0.5)
    assert rep["measured"]["agrees_with_fastest"] == 1.0
    assert rep["params"]["best"] == {"ngram": 12}  # cheapest arm everywhere: no context
    assert rep["fastest"] == {"draft:k=4": 6, "ngram": 6}


def test_learning_curve_full_size_is_the_policy_trained_on_all_prompts():
    # The last point must be the policy `router train` / the alpha sweep trains on the same
    # data and settings, not one trained on a shuffled copy (a different policy when training
    # has not converged), so the report's tables agree with each other.
    train, test = synthetic(12, seed=4), synthetic(12, seed=9)
    train.similarity = np.random.default_rng(5).uniform(0.5, 1.0, train.similarity.shape)
    for seed in range(4):  # a shuffled copy gives another policy for 2 of these 4 seeds
        cfg = TrainConfig(epochs=10, hidden=8, seed=seed)
        art = train_artifact(train, 0.5, "measured", cfg)
        want = replay_scopes(test, policy_choices(art.policy, test.states))
        point = learning_curve(train, test, [len(train)], 0.5, "measured", cfg, draws=3)[-1]
        assert point["draws"] == 1
        assert (point["speedup"], point["mean_speedup"]) == pytest.approx(want)
        sweep = alpha_sweep(train, test, [0.5], "measured", cfg)[0]
        assert (sweep["speedup"], sweep["mean_speedup"]) == pytest.approx(want)


def test_timing_noise_pairs_router_runs_with_the_arms_own_runs():
    data = synthetic(4)
    for row in data.rows.values():
        row["token_ids"] = [1, 2, 3]
    live = [
        # p0: the router ran draft:k=4, 10% slower once its routing time is taken out
        {**data.rows[("p0", "draft:k=4")], "method": "router:r.pt", "route": ["draft:k=4"],
         "wall_time": data.rows[("p0", "draft:k=4")]["wall_time"] * 1.1 + 0.5,
         "route_time": 0.5},
        # p1: ngram, 5% faster
        {**data.rows[("p1", "ngram")], "method": "router:r.pt", "route": ["ngram"],
         "wall_time": data.rows[("p1", "ngram")]["wall_time"] * 0.95},
        # not comparable: two arms over two turns; other tokens
        {**data.rows[("p2", "ar")], "method": "router:r.pt", "route": ["ar", "ngram"]},
        {**data.rows[("p3", "ar")], "method": "router:r.pt", "route": ["ar"], "token_ids": [9]},
    ]
    noise = timing_noise(data, live)
    assert noise["pairs"] == 2
    assert [r["ratio"] for r in noise["ratios"]] == pytest.approx([1.1, 0.95])
    assert noise["median_abs_deviation"] == pytest.approx(0.075)
    assert noise["max_abs_deviation"] == pytest.approx(0.1)
    assert timing_noise(data, [])["median_abs_deviation"] is None


def test_measured_reward_reads_decode_time_not_prefill():
    """A slow prefill (the same work for every arm, here timing noise) must not hide the arm
    that decodes faster: the reward compares decode times."""
    data = synthetic(n=2)
    data.ms_per_token = np.array([[100.0, 130.0, 120.0]] * 2)  # end to end: ar looks fastest
    data.decode_ms_per_token = np.array([[80.0, 40.0, 70.0]] * 2)  # ngram decodes 2x faster
    r = data_rewards(data, alpha=0.0)
    assert r.argmax(1).tolist() == [1, 1] and r[0].tolist() == pytest.approx([0.5, 1.0, 40 / 70])
