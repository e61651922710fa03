"""Cost profiles: interpolation, files, formulas, the per-configuration cache, calibration."""

from __future__ import annotations

import json

import pytest

from adaspec.cost.cache import cached_profile, profile_for, profile_key, profile_path
from adaspec.cost.profile import CostProfile, Curve, load_profile
from adaspec.engine.overhead import loop_overhead_ms
from adaspec.errors import InputError


def test_curve_interpolates_in_n_and_context():
    curve = Curve([1, 2, 4], [100, 300], [[10, 20, 40], [20, 40, 80]])
    assert curve(1, 100) == 10
    assert curve(3, 100) == pytest.approx(30)  # between n=2 and n=4
    assert curve(2, 200) == pytest.approx(30)  # halfway between the contexts
    assert curve(6, 100) == pytest.approx(60)  # the last slope goes on
    assert curve(1, 50) == 10 and curve(1, 1000) == 20  # clamped to the measured contexts
    assert curve(0) == 0.0
    # whole sizes come from a table, in-between ones and those far past the last size are
    # worked out; a row at one context reads the same as one call per size
    assert curve(3.5, 100) == pytest.approx(35) and curve(500, 100) == pytest.approx(5000)
    for context in (None, 50, 100, 200, 300, 1000):
        assert curve.row(40, context) == pytest.approx([curve(n, context) for n in range(1, 41)])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sizes": [2, 1], "contexts": [0], "ms": [[1, 2]]}, "ascend"),
        ({"sizes": [1, 2], "contexts": [0], "ms": [[1]]}, "one value per size"),
        ({"sizes": [1], "contexts": [0], "ms": [[-1]]}, "positive"),
        ({"sizes": [1], "contexts": [0], "ms": [[float("nan")]]}, "positive"),
    ],
)
def test_bad_curves_are_refused(kwargs, message):
    with pytest.raises(InputError, match=message):
        Curve(**kwargs)


def test_step_price_adds_draft_forwards_verification_and_overhead():
    profile = CostProfile(
        target=Curve([1, 2, 3], [0], [[40, 50, 60]]),
        draft=Curve([1], [0], [[10]]),
        overhead_ms=1.5,
    )
    assert profile.step_ms(drafted=2, draft_forwards=2) == pytest.approx(2 * 10 + 60 + 1.5)


def test_json_round_trip_and_atomic_save(tmp_path):
    profile = CostProfile.from_formula("linear:target_ms=30,per_token_ms=2,draft_ms=5")
    path = profile.save(tmp_path / "p.json")
    back = CostProfile.load(path)
    assert back.target(7) == pytest.approx(42) and back.draft(1) == pytest.approx(5)
    assert back.simulated and back.source.startswith("formula:")
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temporary left


def test_flat_formula_is_simulated_and_nearly_flat():
    flat = load_profile("flat")
    assert flat.simulated
    assert flat.target(16) / flat.target(1) < 1.3


@pytest.mark.parametrize(
    "text, message",
    [
        ("cubic:a=1", "unknown cost formula"),
        ("linear:per_token_ms=1", "target_ms"),
        ("linear:target_ms=x", "must be a number"),
        ("linear:target_ms=1,speed=2", "expected one of"),
    ],
)
def test_bad_formulas_name_the_problem(text, message):
    with pytest.raises(InputError, match=message):
        CostProfile.from_formula(text)


def test_unreadable_profile_files(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        CostProfile.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="unreadable"):
        CostProfile.load(bad)
    bad.write_text(json.dumps({"draft": None}))
    with pytest.raises(InputError, match="not a cost profile"):
        CostProfile.load(bad)


def test_calibration_is_cached_per_configuration(target, draft, tokenizer, tmp_path,
                                                  monkeypatch):
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path))
    import adaspec.cost.measure as measure

    monkeypatch.setattr(measure, "CONTEXTS", [16, 48])
    monkeypatch.setattr(measure, "OVERHEAD_TOKENS", 4)
    calls = []
    real = measure.measure_profile

    def counted(*args, **kwargs):
        calls.append(1)
        kwargs.setdefault("contexts", [16, 48])
        kwargs.setdefault("sizes", [1, 2, 4])
        kwargs.setdefault("draft_sizes", [1, 2])
        kwargs.setdefault("repeats", 1)
        return real(*args, **kwargs)

    monkeypatch.setattr(measure, "measure_profile", counted)
    first = profile_for(target, draft, tokenizer, quiet=True, loop_overhead=loop_overhead_ms)
    assert first.target.contexts == [16, 48] and first.draft is not None
    assert first.target(1) > 0 and first.overhead_ms >= 0 and first.bandwidth_gbs > 0
    assert first.key == profile_key(target, draft)
    again = profile_for(target, draft, tokenizer, quiet=True, loop_overhead=loop_overhead_ms)
    assert len(calls) == 1 and again.target.ms == first.target.ms  # read back, not measured
    # Another configuration (the target alone) is its own entry.
    assert cached_profile(profile_key(target, None)) is None
    profile_for(target, None, tokenizer, quiet=True, loop_overhead=loop_overhead_ms)
    assert len(calls) == 2
    assert profile_path(profile_key(target, None)) != profile_path(profile_key(target, draft))
    # A library built with another patch is another configuration: its curves are not
    # reused (the name stays readable, the key tells them apart).
    plain = profile_path(profile_key(target, draft))
    target.patches = ("some-kernel-patch",)
    try:
        patched = profile_key(target, draft)
        assert patched["target"]["patches"] == ["some-kernel-patch"]
        assert profile_path(patched) != plain
        assert cached_profile(patched) is None
    finally:
        del target.patches
    # A rebuild of the same patches (their text may have changed) is another configuration
    target.built_at = "2026-11-28T00:00:00+0000"
    try:
        rebuilt = profile_key(target, draft)
        assert rebuilt["target"]["built_at"] == "2026-11-28T00:00:00+0000"
        assert profile_path(rebuilt) != plain and cached_profile(rebuilt) is None
    finally:
        del target.built_at
    assert cached_profile(profile_key(target, draft)) is not None
    # A corrupt cache entry is measured again, not trusted.
    profile_path(profile_key(target, draft)).write_text("garbage")
    profile_for(target, draft, tokenizer, quiet=True, loop_overhead=loop_overhead_ms)
    assert len(calls) == 3


def test_calibration_plan_shrinks_to_fit_the_budget():
    from adaspec.cost.measure import CONTEXTS, TARGET_SIZES, plan_within_budget

    fast = [(30.0, 100.0, 8.0, TARGET_SIZES)]
    sizes, contexts, repeats = plan_within_budget(fast, CONTEXTS, 3, budget_s=25)
    assert sizes == [TARGET_SIZES] and contexts == CONTEXTS and repeats == 3
    slow = [(350.0, 2500.0, 300.0, TARGET_SIZES)]  # bf16 torch on a CPU without bf16 units
    sizes, contexts, repeats = plan_within_budget(slow, CONTEXTS, 3, budget_s=25)
    assert len(sizes[0]) < len(TARGET_SIZES) and repeats < 3
    assert sizes[0][0] == 1  # the single-token cost is always measured
