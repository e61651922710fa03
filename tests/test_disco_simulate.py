"""The latency simulation and the tuner: hand-computed schedules, agreement with the bench's
oracle schedule, cost measurement, and the tuner picking the latency-optimal setting."""

from __future__ import annotations

import pytest
import torch

from adaspec.control.disco_features import TOP_K
from adaspec.lab.bench.theory import oracle_schedule
from adaspec.lab.disco.dataset import Sample
from adaspec.lab.disco.simulate import NEVER_STOP, Costs, measure_costs, simulate
from adaspec.lab.disco.tune import tune
from tests.disco_helpers import SPEC, classifier_on

COSTS = Costs(draft_ms=10.0, target_ms=[100.0 + 5 * n for n in range(20)])


def test_static_schedule_by_hand():
    hits = [True, True, True, False, True, True, True, True]
    res = simulate(hits, None, NEVER_STOP, 2, COSTS)
    # p=1: draft 1,2 (both hit) -> emit 3 tokens (p=4); p=4: draft 4,5 hit -> p=7;
    # p=7: one token left, nothing drafted (budget) -> target alone
    assert (res.target_calls, res.draft_calls, res.accepted, res.tokens) == (3, 4, 4, 7)
    assert res.time_ms == pytest.approx(2 * (2 * 10 + 110) + 100)


def test_scores_stop_the_draft():
    hits = [True] * 10
    scores = torch.zeros(10, 4)
    scores[:, 0] = 1.0  # keep drafting after position 0 only
    res = simulate(hits, scores, 0.5, 4, COSTS)
    # every step drafts 2 (go on after position 0, stop after 1) and emits 3: p = 1, 4, 7, 10
    assert (res.target_calls, res.draft_calls, res.tokens) == (3, 6, 9)
    static = simulate(hits, scores, NEVER_STOP, 4, COSTS)
    assert static.draft_calls > res.draft_calls


@pytest.mark.parametrize("seed", range(5))
def test_oracle_matches_the_bench_schedule(seed):
    g = torch.Generator().manual_seed(seed)
    hits = (torch.rand(60, generator=g) < 0.7).tolist()
    res = simulate(hits, None, NEVER_STOP, 100, COSTS, oracle=True)
    sched = oracle_schedule(hits)
    assert res.target_calls == sched["target_calls"] - 1  # the simulation leaves out the prefill
    assert res.draft_calls == sched["draft_calls"]
    assert res.accepted == res.draft_calls  # every drafted token accepted
    assert res.tokens == 59


def test_measure_costs_on_tiny_models(target, draft):
    calls = []
    costs = measure_costs(
        target, draft, [1, 2, 3, 4, 5], 3, repeats=2, decision=lambda: calls.append(1)
    )
    assert len(costs.target_ms) == 4 and all(t > 0 for t in costs.target_ms)
    assert costs.draft_ms > 0 and costs.decision_ms >= 0 and calls
    assert target.cache_len == 0 and draft.cache_len == 0


def synthetic_sample(hits: list[bool]) -> Sample:
    """Top draft probability 0.9 where the draft is right, 0.1 where it is wrong."""
    dist = torch.zeros(len(hits), TOP_K + 1)
    dist[:, 0] = torch.tensor([0.9 if h else 0.1 for h in hits])
    return Sample("s", "toy", "c", "val", [1], [0] * len(hits), dist, torch.tensor(hits))


@pytest.mark.parametrize("draft_ms", [10.0, 500.0])
def test_tune_picks_the_latency_optimal_setting(draft_ms):
    """Cheap drafts: draft as long as the target agrees, so a long static k wins and a
    classifier that knows where the draft goes wrong wins more. Drafts dearer than the target:
    static k = 1."""
    hits = ([True] * 21 + [False]) * 4
    samples = [synthetic_sample(hits)]
    clf = classifier_on(0, 40.0, -20.0)  # P(accept) = sigmoid(40 * top1 - 20): 1 / 0
    costs = Costs(draft_ms=draft_ms, target_ms=[100.0] * 20)
    result = tune(samples, costs, clf, SPEC, taus=(0.05, 0.5, 0.95), sl_maxes=range(1, 9))
    best = result["best"]
    for family in ("static", "disco", "confidence"):
        assert best[family]["ms_per_token"] == min(r["ms_per_token"] for r in result[family])
    assert best["static"]["sl_max"] >= 6 if draft_ms < 100 else best["static"]["sl_max"] == 1
    assert best["disco"]["ms_per_token"] <= best["static"]["ms_per_token"]
    # the confidence rule reads the same top-1 column, so it is as good here
    assert best["confidence"]["ms_per_token"] == pytest.approx(best["disco"]["ms_per_token"])
    if draft_ms < 100:  # the oracle never wastes a draft: the floor when drafts are cheap
        assert result["oracle"]["ms_per_token"] <= best["disco"]["ms_per_token"]
        assert best["disco"]["ms_per_token"] < best["static"]["ms_per_token"]


def test_a_measured_run_is_priced_by_its_own_calls():
    from adaspec.lab.disco.simulate import price_run

    costs = Costs(draft_ms=10.0, target_ms=[100.0, 120.0, 150.0], decision_ms=1.0)
    # two turns: steps of 2 and 1 drafted tokens, one plain target call, 3 draft calls
    run = {"steps": [[2, 2], [1, 0]], "turn_tokens": [3, 2], "target_calls": 5, "draft_calls": 3}
    assert price_run(run, costs) == pytest.approx(150 + 120 + 100 + 3 * 10)
    assert price_run(run, costs, decides=True) == pytest.approx(400 + 3 * 1.0)
    plain = {"steps": [], "turn_tokens": [4], "target_calls": 4, "draft_calls": 0}
    assert price_run(plain, costs) == pytest.approx(3 * 100)  # the prefill is not priced
    longer = {"steps": [[3, 3]], "turn_tokens": [4], "target_calls": 2, "draft_calls": 3}
    assert price_run(longer, costs) is None  # 4 tokens verified, 3 timed


def test_best_schedule_is_the_floor_of_every_length_policy():
    import random

    from adaspec.lab.disco.simulate import best_schedule

    costs = Costs(draft_ms=30.0, target_ms=[100.0, 110.0, 125.0, 200.0, 400.0])
    rng = random.Random(0)
    for _ in range(20):
        hits = [rng.random() < 0.7 for _ in range(12)]

        def brute(p: int, hits: list[bool] = hits) -> float:  # every schedule, enumerated
            if p >= len(hits):
                return 0.0
            out = []
            for d in range(min(4, len(hits) - p - 1) + 1):
                a = 0
                while a < d and hits[p + a]:
                    a += 1
                out.append(d * costs.draft_ms + costs.target(d + 1) + brute(p + a + 1, hits))
            return min(out)

        best = best_schedule(hits, costs, 4)
        assert best.time_ms == pytest.approx(brute(1))
        assert best.tokens == len(hits) - 1
        for k in range(0, 5):
            assert best.time_ms <= simulate(hits, None, NEVER_STOP, k, costs).time_ms + 1e-9
        oracle = simulate(hits, None, NEVER_STOP, 4, costs, oracle=True)
        assert best.time_ms <= oracle.time_ms + 1e-9
