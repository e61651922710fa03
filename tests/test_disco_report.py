"""The DISCO report's measured comparisons: DISCO against the best static k and the heuristic
and the share of the static-to-oracle gap it closes, end to end and without the target's
prompt prefill (the same work in every arm)."""

from __future__ import annotations

import pytest

from adaspec.disco.bench import HEURISTIC, ORACLE, Arm
from adaspec.disco.report import _measured_table, _scope_table, gap_closed

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
