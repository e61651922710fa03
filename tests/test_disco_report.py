"""The DISCO report's measured comparisons: DISCO against the best static k and the heuristic
and the share of the static-to-oracle gap it closes, end to end and without the target's
prompt prefill (the same work in every arm)."""

from __future__ import annotations

import pytest

from adaspec.lab.disco.compare import HEURISTIC, ORACLE
from adaspec.lab.disco.disco_report import (
    Arm,
    _in_domain_table,
    _mean_of_suites,
    _measured_table,
    _scope_table,
    gap_closed,
)

from .test_bench_report import row

ARMS = [
    Arm("plain", "ar", "ar"),
    Arm("static k=2 [he]", "draft:k=2", "static", "he"),
    Arm("DISCO [he]", "draft:ctrl=disco,disco=a.pt", "disco", "he"),
    Arm("heuristic", HEURISTIC, "heuristic"),
    Arm("oracle", ORACLE, "oracle"),
]


def _rows() -> list[dict]:
    """One prompt, 10 tokens each; a 4 s target prefill in every arm, whose decode takes
    ar 6 s, static 4 s, DISCO 3 s, heuristic 5 s, oracle 2 s."""
    decode = {"ar": 6.0, "draft:k=2": 4.0, ARMS[2].method: 3.0, HEURISTIC: 5.0, ORACLE: 2.0}
    return [row("p", "humaneval", m, 4.0 + s, 10, prefill_time=4.0) for m, s in decode.items()]


def test_comparisons_end_to_end_and_on_decode_latency():
    t = _scope_table(_rows(), ARMS, "he")
    assert t["compare"]["static"] == "static k=2 [he]" and t["compare"]["disco"] == "DISCO [he]"
    assert t["disco_vs_static"] == pytest.approx(7.0 / 8.0)
    assert t["decode_disco_vs_static"] == pytest.approx(3.0 / 4.0)
    assert t["decode_disco_vs_heuristic"] == pytest.approx(3.0 / 5.0)
    assert t["gap_closed"]["DISCO [he]"] == pytest.approx((8 - 7) / (8 - 6))
    assert t["decode_gap_closed"]["DISCO [he]"] == pytest.approx((4 - 3) / (4 - 2))
    disco = t["arms"]["DISCO [he]"]
    assert disco["decode_ms_per_token"] == pytest.approx(300.0)
    assert disco["decode_speedup"] == pytest.approx(2.0)
    assert disco["speedup"] == pytest.approx(10 / 7)


def test_measured_tables_show_either_latency():
    measured = {"humaneval": _scope_table(_rows(), ARMS, "he")}
    decode, end_to_end = _measured_table(measured, "decode_"), _measured_table(measured, "")
    assert "| humaneval | 600 (1.00x) | 400 (1.50x) | 300 (2.00x)" in decode[2]
    assert "| humaneval | 1000 (1.00x) | 800 (1.25x) | 700 (1.43x)" in end_to_end[2]


def test_gap_closed_is_undefined_when_static_is_already_the_oracle():
    assert gap_closed(100.0, 90.0, 100.0) is None
    assert gap_closed(100.0, 110.0, 80.0) == pytest.approx(-0.5)


def test_steady_comparison_leaves_the_draft_prefill_out():
    rows = _rows()
    for r in rows:
        if r["method"] != "ar":
            r["draft_prefill_time"] = 1.0  # the same start-up cost in every drafting arm
    t = _scope_table(rows, ARMS, "he")
    assert t["decode_disco_vs_static"] == pytest.approx(3.0 / 4.0)
    assert t["steady_disco_vs_static"] == pytest.approx(2.0 / 3.0)
    assert t["arms"]["DISCO [he]"]["steady_speedup"] == pytest.approx(6.0 / 2.0)


def _two_suites() -> tuple[list, list[dict]]:
    """A HumanEval prompt and a Spec-Bench prompt; each suite's static k and DISCO run its
    own prompt in 4 and 3 s (decode), the other suite's artifact in 10 s."""
    arms = [
        Arm("plain", "ar", "ar"),
        Arm("static [he]", "draft:k=3", "static", "humaneval"),
        Arm("confidence [he]", "draft:ctrl=confidence,threshold=0.5,k=3", "confidence",
            "humaneval"),
        Arm("DISCO [he]", "draft:ctrl=disco,disco=he.pt", "disco", "humaneval"),
        Arm("static [sb]", "draft:k=2", "static", "spec-bench"),
        Arm("confidence [sb]", "draft:ctrl=confidence,threshold=0.6,k=2", "confidence",
            "spec-bench"),
        Arm("DISCO [sb]", "draft:ctrl=disco,disco=sb.pt", "disco", "spec-bench"),
        Arm("heuristic", HEURISTIC, "heuristic"),
        Arm("oracle", ORACLE, "oracle"),
    ]
    own = {"humaneval": "p1", "spec-bench": "p2"}
    rows = []
    for suite, pid in own.items():
        cat = "humaneval" if suite == "humaneval" else "qa"
        for a in arms:
            if a.family in ("ar", "heuristic", "oracle"):
                decode = {"ar": 6.0, "heuristic": 5.0, "oracle": 2.0}[a.family]
            elif a.artifact == suite:
                decode = {"static": 4.0, "confidence": 3.5, "disco": 3.0}[a.family]
            else:
                decode = 10.0
            if any(r["method"] == a.method and r["prompt_id"] == pid for r in rows):
                continue
            rows.append(row(pid, cat, a.method, 1.0 + decode, 10, prefill_time=1.0))
    return arms, rows


def test_overall_pairs_each_suite_with_its_own_artifact():
    arms, rows = _two_suites()
    suite_of = {"humaneval": "humaneval", "qa": "spec-bench"}
    t = _in_domain_table(rows, arms, suite_of, ["humaneval", "spec-bench"])
    assert t["compare"]["disco"] == "disco [in domain]"
    assert t["arms"]["disco [in domain]"]["prompts"] == 2
    assert t["decode_disco_vs_static"] == pytest.approx(6.0 / 8.0)  # not (3 + 10) / (4 + 10)
    assert t["decode_disco_vs_heuristic"] == pytest.approx(6.0 / 10.0)
    # a suite with no artifact of its own: no in-domain pairing
    assert _in_domain_table(rows, arms[:4] + arms[7:], suite_of, ["humaneval", "spec-bench"]) \
        is None


def test_mean_of_suites_weighs_each_suite_the_same():
    measured = {
        "humaneval (all)": {"compare": {"home_artifact": "humaneval"},
                            "decode_disco_vs_static": 1.1},
        "spec-bench (all)": {"compare": {"home_artifact": "spec-bench"},
                             "decode_disco_vs_static": 0.8},
    }
    mean = _mean_of_suites(measured, ["humaneval", "spec-bench"])
    assert mean["decode_disco_vs_static"] == pytest.approx(0.95)
    assert mean["disco_vs_heuristic"] is None


def test_limits_per_category():
    from adaspec.errors import InputError
    from adaspec.lab.disco.compare import parse_limits

    assert parse_limits("2,rag:1,summarization:1") == (2, {"rag": 1, "summarization": 1})
    assert parse_limits("rag:1") == (None, {"rag": 1})
    assert parse_limits(None) == (None, {})
    for bad in ("0", "rag:x", "two"):
        with pytest.raises(InputError, match="--limit"):
            parse_limits(bad)


def test_priced_comparison_sees_the_calls_not_the_clock():
    from adaspec.lab.disco.simulate import Costs

    costs = Costs(draft_ms=10.0, target_ms=[100.0, 120.0, 150.0], decision_ms=0.5)
    rows = _rows()
    for r in rows:
        r["turn_tokens"] = [10]
        if r["method"] in ("draft:k=2", ARMS[2].method):  # the same calls, different clocks
            r.update(steps=[[2, 2]] * 3 + [[0, 0]], target_calls=5, draft_calls=6)
    t = _scope_table(rows, ARMS, "he", costs)
    assert t["decode_disco_vs_static"] == pytest.approx(3.0 / 4.0)
    static_ms = (3 * 150 + 100 + 6 * 10) / 10
    assert t["arms"]["static k=2 [he]"]["priced_ms_per_token"] == pytest.approx(static_ms)
    assert t["priced_disco_vs_static"] == pytest.approx((static_ms + 6 * 0.5 / 10) / static_ms)
    assert t["arms"]["plain"]["priced_ms_per_token"] == pytest.approx(9 * 100 / 10)
    assert t["arms"]["static k=2 [he]"]["priced_speedup"] == pytest.approx(90 / static_ms)
