"""Summary arithmetic on synthetic rows, the theory formulas and the oracle schedule."""

from __future__ import annotations

import copy

import pytest
import torch

from adaspec.backends.torch.backend import TorchBackend
from adaspec.engine.loop import Engine
from adaspec.lab.bench.plots import acceptance_by_position
from adaspec.lab.bench.report import summarize, to_markdown
from adaspec.lab.bench.theory import (
    expected_tokens_per_step,
    leviathan_speedup,
    oracle_schedule,
    per_token_alpha,
    teacher_forced_hits,
)


def row(pid, cat, method, wall, tokens, **kw):
    base = {
        "prompt_id": pid,
        "category": cat,
        "method": method,
        "repeat": 0,
        "divergence": None,
        "new_tokens": tokens,
        "wall_time": wall,
        "target_calls": tokens,
        "draft_calls": 0,
        "drafted": 0,
        "accepted": 0,
        "prefill_time": 0.0,
        "draft_time": 0.0,
        "verify_time": 0.0,
        "steps": [],
    }
    base.update(kw)
    return base


def synthetic_rows():
    return [
        # category A: ar 10 tokens in 2 s and 10 tokens in 1 s; m twice as fast on the first.
        row("p1", "A", "ar", 2.0, 10, verify_time=1.8, prefill_time=0.1),
        row("p2", "A", "ar", 1.0, 10, verify_time=0.9, prefill_time=0.05),
        row("p3", "B", "ar", 3.0, 20, verify_time=2.7, prefill_time=0.2),
        row(
            "p1",
            "A",
            "m",
            1.0,
            10,
            target_calls=4,
            draft_calls=9,
            drafted=9,
            accepted=6,
            draft_time=0.4,
            verify_time=0.5,
            prefill_time=0.1,
            steps=[[3, 3], [3, 2], [3, 1]],
        ),
        row(
            "p2",
            "A",
            "m",
            1.0,
            10,
            target_calls=5,
            draft_calls=6,
            drafted=6,
            accepted=5,
            draft_time=0.3,
            verify_time=0.6,
            prefill_time=0.05,
            steps=[[3, 3], [3, 2]],
            divergence={"index": 4, "gap": 0.01, "kind": "tie", "turn": 0},
        ),
        row(
            "p3",
            "B",
            "m",
            1.5,
            20,
            target_calls=10,
            draft_calls=12,
            drafted=12,
            accepted=10,
            draft_time=0.6,
            verify_time=0.8,
            prefill_time=0.2,
            steps=[[4, 4], [4, 4], [4, 2]],
            divergence={"index": 7, "gap": 3.5, "kind": "bug", "turn": 0},
        ),
        # p4 has no ar row: counted in the method's totals, not in its speedup.
        row("p4", "B", "m", 5.0, 10, target_calls=10),
    ]


def test_speedup_is_a_ratio_of_paired_runs_per_category_and_overall():
    s = summarize(synthetic_rows(), ["ar", "m"], theory_methods=["m"])
    a = s["categories"]["A"]["m"]
    # ar: 3 s / 20 tokens; m: 2 s / 20 tokens -> 1.5x
    assert a["speedup"] == pytest.approx((3.0 / 20) / (2.0 / 20))
    assert a["median_prompt_speedup"] == pytest.approx((2.0 + 1.0) / 2)
    b = s["categories"]["B"]["m"]
    assert b["paired_prompts"] == 1 and b["prompts"] == 2
    assert b["speedup"] == pytest.approx((3.0 / 20) / (1.5 / 20))
    overall = s["methods"]["m"]
    assert overall["speedup"] == pytest.approx((6.0 / 40) / (3.5 / 40))
    assert s["methods"]["ar"]["speedup"] == pytest.approx(1.0)
    # totals include the unpaired row
    assert overall["new_tokens"] == 50 and overall["wall_time"] == pytest.approx(8.5)
    assert overall["tokens_per_s"] == pytest.approx(50 / 8.5)
    assert overall["ms_per_token"] == pytest.approx(1000 * 8.5 / 50)


def test_decode_figures_leave_the_target_prefill_out():
    s = summarize(synthetic_rows(), ["ar", "m"], theory_methods=["m"])
    a = s["categories"]["A"]["m"]
    # ar decodes in (2 - 0.1) + (1 - 0.05) s, m in (1 - 0.1) + (1 - 0.05) s; 20 tokens each
    assert a["decode_speedup"] == pytest.approx(2.85 / 1.85)
    assert a["decode_ms_per_token"] == pytest.approx(1000 * 1.85 / 20)
    overall = s["methods"]["m"]
    assert overall["decode_ms_per_token"] == pytest.approx(1000 * (8.5 - 0.35) / 50)
    assert overall["decode_speedup"] == pytest.approx((5.65 / 40) / (3.15 / 40))
    assert "decode ms/token (speedup)" in to_markdown(s)
    assert "## Decode speedup by category" in to_markdown(s)


def test_steady_figures_leave_the_draft_prefill_out_too():
    rows = [
        row("p", "A", "ar", 3.0, 10, prefill_time=1.0),
        row("p", "A", "m", 4.0, 10, prefill_time=1.0, draft_time=2.0, draft_prefill_time=1.5),
    ]
    m = summarize(rows, ["ar", "m"])["methods"]["m"]
    assert m["decode_ms_per_token"] == pytest.approx(300.0)  # the draft prefill stays in
    assert m["steady_ms_per_token"] == pytest.approx(150.0)
    assert m["steady_speedup"] == pytest.approx(2.0 / 1.5)
    assert m["decode_speedup"] == pytest.approx(2.0 / 3.0)
    assert "| 150 (1.33x) |" in to_markdown(summarize(rows, ["ar", "m"]))
    # a drafting row recorded before the draft prefill was timed apart has no steady figure
    old = [rows[0], row("p", "A", "m", 4.0, 10, prefill_time=1.0, draft_calls=3)]
    m = summarize(old, ["ar", "m"])["methods"]["m"]
    assert m["steady_ms_per_token"] is None and m["steady_speedup"] is None
    assert m["decode_ms_per_token"] == pytest.approx(300.0)


def test_mat_acceptance_alpha_and_time_split():
    s = summarize(synthetic_rows(), ["ar", "m"])
    a = s["categories"]["A"]["m"]
    assert a["mean_accepted_tokens"] == pytest.approx(20 / 9)
    assert a["acceptance_rate"] == pytest.approx(11 / 15)
    # accepted 11 over tested 11 + 3 rejecting steps
    assert a["alpha"] == pytest.approx(11 / 14)
    assert a["mean_draft_length"] == pytest.approx(3.0)
    split = a["time_split"]
    assert split["draft_time"] == pytest.approx(0.7 / 2.0)
    assert split["verify_time"] == pytest.approx(1.1 / 2.0)
    assert split["prefill_time"] == pytest.approx(0.15 / 2.0)
    assert sum(split.values()) == pytest.approx(1.0)
    assert s["methods"]["ar"]["mean_accepted_tokens"] == pytest.approx(1.0)
    assert s["methods"]["ar"]["acceptance_rate"] is None


def test_bandwidth_from_weight_bytes_and_calls():
    s = summarize(synthetic_rows(), ["ar", "m"], target_bytes=2_000_000_000)
    ar = s["methods"]["ar"]
    assert ar["target_gbs"] == pytest.approx(2.0 * 40 / 6.0)
    assert ar["target_gbs_in_forward"] == pytest.approx(2.0 * 40 / (5.4 + 0.35))


def test_exactness_counts_and_loud_markdown():
    s = summarize(synthetic_rows(), ["ar", "m"])
    ex = s["exactness"]
    assert (ex["checked"], ex["differs"], ex["numerical_ties"], ex["bugs"]) == (4, 2, 1, 1)
    assert s["methods"]["m"]["bugs"] == 1 and s["categories"]["A"]["m"]["bugs"] == 0
    md = to_markdown(s)
    assert "1 BUG(S)" in md and "| p3 | `m` |" in md and "| BUG |" in md
    assert "## Speedup by category" in md and "| `m` | 1.50x | 2.00x | 1.71x |" in md
    clean = summarize([r for r in synthetic_rows() if not r["divergence"]], ["ar", "m"])
    assert "greedy outputs equal plain decoding" in to_markdown(clean)


def test_theory_uses_costs_measured_in_the_run():
    rows = synthetic_rows()[:4]
    rows[0]["oracle"] = {"new_tokens": 10, "target_calls": 3, "draft_calls": 7, "steps": [4, 3]}
    s = summarize(rows, ["ar", "m"], theory_methods=["m"])
    t = s["theory"]["m"]
    t_target = 1.8 / 9  # ar's per-call decode time on the paired prompt
    t_draft = 0.4 / 9
    t_verify = 0.5 / 3
    assert t["c"] == pytest.approx(t_draft / t_target)
    assert t["gamma"] == pytest.approx(3.0)
    assert t["alpha"] == pytest.approx(6 / 8)
    assert t["leviathan_speedup"] == pytest.approx(leviathan_speedup(6 / 8, 3.0, t["c"]))
    assert t["oracle_mat"] == pytest.approx(10 / 3)
    oracle_s = 0.1 + 2 * t_verify + 7 * t_draft
    assert t["oracle_speedup"] == pytest.approx((2.0 / 10) / (oracle_s / 10))
    assert "## Theory beside practice" in to_markdown(s)
    # ngram-like methods (not listed as draft-model methods) get no theory row
    assert summarize(rows, ["ar", "m"])["theory"] == {}


def test_leviathan_formula_limits():
    assert expected_tokens_per_step(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens_per_step(1.0, 4) == pytest.approx(5.0)
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert leviathan_speedup(0.0, 4, 0.25) == pytest.approx(1 / 2)
    assert leviathan_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    assert per_token_alpha([(4, 4), (4, 0)]) == pytest.approx(4 / 5)
    assert per_token_alpha([]) is None


def test_oracle_schedule_drafts_runs_of_hits():
    #        token: 0      1     2     3      4     5     6
    hits = [False, True, True, False, True, True, True]
    sched = oracle_schedule(hits)
    # prefill gives token 0; step 1 drafts tokens 1-2, target adds 3; step 2 drafts 4-5
    # (token 6 is the last one: the target adds it).
    assert sched["steps"] == [2, 2]
    assert sched["target_calls"] == 3 and sched["draft_calls"] == 4
    assert oracle_schedule([True])["target_calls"] == 1
    assert oracle_schedule([False] * 4) == {
        "new_tokens": 4,
        "target_calls": 4,
        "draft_calls": 0,
        "steps": [0, 0, 0],
    }


def test_teacher_forced_hits_with_a_perfect_and_a_different_draft(target_model, draft_model):
    target = TorchBackend(target_model)
    engine = Engine(target, None, eos_token_ids=[])
    prompt = [3, 4, 5, 6]
    out = engine.generate(prompt, max_new_tokens=20).token_ids
    twin = TorchBackend(copy.deepcopy(target_model))
    assert teacher_forced_hits(twin, prompt, out, chunk=5) == [True] * len(out)
    hits = teacher_forced_hits(TorchBackend(draft_model), prompt, out, chunk=3)
    assert len(hits) == len(out) and not all(hits)
    # chunking does not change the predictions
    assert hits == teacher_forced_hits(TorchBackend(draft_model), prompt, out, chunk=256)
    assert torch.is_grad_enabled()


def test_acceptance_by_position():
    rates, counts = acceptance_by_position([(3, 3), (3, 1), (2, 0)])
    assert counts == [3, 3, 2]
    assert rates == pytest.approx([2 / 3, 1 / 3, 1 / 2])


def test_tokens_per_call_counts_calls_without_a_draft():
    from adaspec.lab.bench.plots import tokens_per_call

    # 6 target calls: the prefill, 3 verified drafts, 2 with nothing to verify
    rows = [{"target_calls": 6, "steps": [[4, 4], [4, 0], [2, 1]]}]
    assert sorted(tokens_per_call(rows)) == [1, 1, 1, 2, 5]
