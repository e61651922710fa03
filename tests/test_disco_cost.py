"""DISCO's cost rule (stop=cost): it weighs the classifier's acceptance probability of one
more token against that token's price on the machine's cost profile, so the same classifier
outputs stop earlier where verification is dear; the tuner and the simulator price with the
same profile (`Costs.from_profile`); greedy output stays exact."""

from __future__ import annotations

import copy

import pytest
import torch

from adaspec.backends.torch.backend import TorchBackend
from adaspec.cli import main
from adaspec.control.disco import COST_SL_MAX, DiscoLength, cost_keeps_drafting
from adaspec.control.disco_artifact import DiscoArtifact
from adaspec.control.disco_features import TOP_K
from adaspec.cost.profile import FLAT_FORMULA, CostProfile, Curve
from adaspec.errors import InputError
from adaspec.lab.disco.dataset import DiscoData, Sample
from adaspec.lab.disco.simulate import NEVER_STOP, Costs, price_run, simulate
from adaspec.lab.disco.tune import evaluate, tune
from adaspec.methods.build import build_generator
from tests.cost_helpers import steep, stub_machine_profile
from tests.disco_helpers import SPEC, artifact, constant_classifier
from tests.test_engine import PROMPTS, reference_greedy


@pytest.fixture(autouse=True)
def measured(monkeypatch, tmp_path):
    return stub_machine_profile(monkeypatch, tmp_path, flat)


def flat() -> CostProfile:
    """GPU-like: verification almost free, drafting cheap."""
    return CostProfile.from_formula("linear:target_ms=20,per_token_ms=0.25,draft_ms=0.5")


def drafted_per_step(ctrl: DiscoLength, steps: int = 3) -> list[int]:
    """Ask the controller as a drafter does, for a few steps: tokens drafted per step."""
    ctrl.begin()
    out = []
    logits = torch.zeros(64)
    for _ in range(steps):
        limit = ctrl.max_tokens()
        n = 0
        while n < limit:
            n += 1
            if not ctrl.keep_drafting(n - 1, logits):
                break
        ctrl.update(n, n)
        out.append(n)
    return out


# ------------------------------------------------------------------------ the rule
def test_rule_by_hand():
    # step_ms[n]: 10 ms per draft token + a verification of 100 + 20 (n + 1) ms
    prices = [100 + 20 * (n + 1) + 10 * n for n in range(9)]
    # p = 0.9 after one token: 1.9 tokens / 150 ms = 0.01267; two: 2.71 / 180 = 0.01506: go on
    assert cost_keeps_drafting([0.9], 0.9, prices, 8)
    # p = 0.2: 1.2 / 150 = 0.008; 1.24 / 180 = 0.0069, 1.248 / 210, 1.2496 / 240: stop
    assert not cost_keeps_drafting([0.2], 0.2, prices, 8)
    # the cap: nothing to look ahead to
    assert not cost_keeps_drafting([0.9] * 8, 0.9, prices, 8)


def test_lookahead_sees_past_a_step_in_the_curve():
    """One more token costs a jump (a kernel on blocks of 4 rows), two more are cheap: the
    rule looks ahead, so it does not stop at the jump."""
    prices = [100.0, 110.0, 112.0, 114.0, 150.0, 151.0, 152.0, 153.0, 154.0]
    probs = [0.99] * 3
    value = [1 + sum(0.99**i for i in range(1, n + 1)) for n in range(9)]
    assert value[4] / prices[4] < value[3] / prices[3] < value[5] / prices[5]
    assert cost_keeps_drafting(probs, 0.99, prices, 8)  # two more pay
    assert not cost_keeps_drafting(probs, 0.99, prices, 4)  # only one more allowed: a loss


@pytest.mark.parametrize("p_accept", [0.8, 0.9])
def test_stops_earlier_under_a_steep_profile(p_accept):
    """The same classifier outputs: under this CPU's costs the rule stops after a token or
    two; where verification is nearly free it drafts to the cap."""
    art = artifact(constant_classifier(p_accept), sl_max=2)
    dear = drafted_per_step(DiscoLength(art, stop="cost", profile=steep()))
    cheap = drafted_per_step(DiscoLength(art, stop="cost", profile=flat()))
    assert max(dear) < min(cheap)
    assert cheap == [COST_SL_MAX] * 3  # the cost rule's own cap, not the artifact's tau SL_max
    # the tau rule ignores costs: with tau below p it drafts its SL_max whatever the machine
    assert drafted_per_step(DiscoLength(art, tau=0.5)) == [2] * 3


def test_guess_mean_reads_the_running_mean():
    """guess=mean: the next token's acceptance is the request's mean probability so far."""
    ctrl = DiscoLength(artifact(constant_classifier(0.9)), stop="cost", profile=steep(),
                       guess="mean")
    ctrl.begin()
    ctrl.max_tokens()
    ctrl.keep_drafting(0, torch.zeros(64))
    assert ctrl._sum / ctrl._count == pytest.approx(0.9, abs=1e-4)


def test_cost_rule_needs_a_profile_with_a_draft():
    art = artifact(constant_classifier(0.9))
    with pytest.raises(InputError, match="cost profile"):
        DiscoLength(art, stop="cost")
    no_draft = CostProfile(target=Curve([1, 2], [0], [[10.0, 20.0]]))
    with pytest.raises(InputError, match="measured the draft"):
        DiscoLength(art, stop="cost", profile=no_draft)
    with pytest.raises(InputError, match="stop rule"):
        DiscoLength(art, stop="costs", profile=flat())
    with pytest.raises(InputError, match="guess"):
        DiscoLength(art, stop="cost", profile=flat(), guess="median")


def test_tuned_cap_and_guess_are_the_defaults():
    art = artifact(constant_classifier(0.9))
    art.tuning = {"best": {"disco-cost": {"sl_max": 3, "guess": "mean"}}}
    ctrl = DiscoLength(art, stop="cost", profile=flat())
    assert (ctrl.sl_max, ctrl.guess) == (3, "mean")
    ctrl = DiscoLength(art, stop="cost", profile=flat(), sl_max=5, guess="last")
    assert (ctrl.sl_max, ctrl.guess) == (5, "last")
    assert DiscoLength(art).stop == "tau"  # the default rule, for every stored artifact


# ----------------------------------------------------------------------- the engine
@pytest.fixture
def disco_file(tmp_path):
    path = tmp_path / "a.pt"
    artifact(constant_classifier(0.8), sl_max=2).save(path)
    return str(path)


@pytest.mark.parametrize("profile", ["flat", "steep"])
def test_greedy_equals_plain_decoding(target, draft, target_model, disco_file, profile):
    costs = flat() if profile == "flat" else steep()
    engine = build_generator(f"draft:ctrl=disco,disco={disco_file},stop=cost", target, None,
                          draft, eos_token_ids=[], profile=costs)
    assert engine.controller.stop == "cost" and engine.controller.profile is costs
    for prompt in PROMPTS:
        res = engine.generate(prompt, max_new_tokens=30)
        assert res.token_ids == reference_greedy(target_model, prompt, 30), prompt
        assert res.stats.drafted > 0


def test_engine_drafts_less_under_a_steep_profile(target_model, disco_file):
    """The target as its own draft accepts everything: only the stop rule ends a draft."""
    lengths = {}
    for name, method in (
        ("flat", f"draft:ctrl=disco,disco={disco_file},stop=cost,profile=flat"),
        ("steep", f"draft:ctrl=disco,disco={disco_file},stop=cost"),
    ):
        twin = TorchBackend(copy.deepcopy(target_model), name="tiny-draft")
        engine = build_generator(method, TorchBackend(target_model, name="tiny-target"), None,
                              twin, eos_token_ids=[], profile=steep() if name == "steep" else None)
        res = engine.generate(PROMPTS[0], max_new_tokens=30)
        assert res.token_ids == reference_greedy(target_model, PROMPTS[0], 30)
        lengths[name] = max(d for d, _ in res.stats.steps)
    assert lengths["steep"] < lengths["flat"]


def test_method_strings(target, draft, disco_file, measured):
    with pytest.raises(InputError, match="threshold is tau"):
        build_generator(f"draft:ctrl=disco,disco={disco_file},stop=cost,threshold=0.4", target,
                     None, draft, profile=flat())
    with pytest.raises(InputError, match="ctrl=disco's settings"):
        build_generator("draft:k=3,stop=cost", target, None, draft)
    with pytest.raises(InputError, match="profile prices"):
        build_generator("draft:k=3,profile=flat", target, None, draft)
    assert measured == []  # a method that does not price steps never measures the machine
    # no profile anywhere: this machine's, for these backends
    engine = build_generator(f"draft:ctrl=disco,disco={disco_file},stop=cost", target, None, draft)
    assert measured == [("tiny-target", "tiny-draft")] and engine.controller.stop == "cost"
    engine = build_generator(f"draft:ctrl=disco,disco={disco_file},stop=cost,profile=flat,"
                          "guess=mean,sl_max=5", target, None, draft)
    ctrl = engine.controller
    assert (ctrl.stop, ctrl.guess, ctrl.sl_max, ctrl.profile.simulated) == ("cost", "mean", 5, True)
    assert build_generator(f"draft:ctrl=disco,disco={disco_file}", target, None,
                        draft).controller.stop == "tau"


# -------------------------------------------------------------- simulation and tuning
def test_costs_from_profile_are_the_profiles_prices():
    profile = steep()
    profile.overhead_ms = 2.0
    costs = Costs.from_profile(profile, 4)
    assert costs.draft_ms == pytest.approx(15.0)
    assert costs.target_ms == pytest.approx([34.0, 44.0, 54.0, 64.0, 74.0])
    for n in range(5):
        assert costs.step_ms(n) == pytest.approx(profile.step_ms(n, n))
    assert costs.simulated and costs.source.startswith("profile:formula:")
    again = Costs(**costs.to_dict())  # stored in an artifact and read back
    assert again == costs
    old = Costs(**{"draft_ms": 15.0, "target_ms": [34.0, 44.0], "decision_ms": 0.1,
                   "context_tokens": 200, "repeats": 5})  # an artifact from before profiles
    assert old.step_ms(1) == pytest.approx(59.0) and old.source == "measured"
    row = {"steps": [[1, 1]], "target_calls": 3, "draft_calls": 1, "turn_tokens": [3]}
    # one drafting step (44 + 15) and one plain step (34), 2 ms overhead each
    assert price_run(row, costs) == pytest.approx(44 + 15 + 34 + 2 * 2.0)
    with pytest.raises(InputError, match="measured the draft"):
        Costs.from_profile(CostProfile(target=Curve([1], [0], [[10.0]])), 4)


def test_simulated_cost_rule_drafts_less_when_verification_is_dear():
    hits = [True] * 40
    scores = torch.full((40, 8), 0.8)
    dear = simulate(hits, scores, NEVER_STOP, 8, Costs.from_profile(steep(), 8), stop="cost")
    cheap = simulate(hits, scores, NEVER_STOP, 8, Costs.from_profile(flat(), 8), stop="cost")
    assert dear.draft_calls / dear.target_calls < cheap.draft_calls / cheap.target_calls
    # the threshold rule with tau below every score drafts to the cap under either profile
    tau = simulate(hits, scores, 0.5, 8, Costs.from_profile(steep(), 8))
    assert tau.draft_calls / tau.target_calls > dear.draft_calls / dear.target_calls


def samples(n: int = 3, length: int = 30, split: str = "val") -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        top = torch.rand(length, TOP_K, generator=g).sort(dim=-1, descending=True).values
        dist = torch.cat([top / top.sum(-1, keepdim=True), torch.rand(length, 1, generator=g)], 1)
        out.append(Sample(f"p{i}", "humaneval", "humaneval", split, [1, 2, 3],
                          list(range(length)), dist, torch.rand(length, generator=g) < 0.7))
    return out


def test_tune_tables_the_cost_rule():
    costs = Costs.from_profile(steep(), 8)
    result = tune(samples(), costs, constant_classifier(0.8), SPEC, taus=(0.5,), sl_maxes=(1, 2, 3))
    rows = result["disco-cost"]
    assert {(r["sl_max"], r["guess"]) for r in rows} == {(k, g) for k in (1, 2, 3)
                                                         for g in ("last", "mean")}
    best = result["best"]["disco-cost"]
    assert best["stop"] == "cost" and best["ms_per_token"] == min(r["ms_per_token"] for r in rows)
    assert result["costs"]["source"].startswith("profile:")
    assert result["ar_ms_per_token"] == pytest.approx(34.0)
    sim = evaluate(samples(), costs, constant_classifier(0.8), SPEC,
                   {"disco-cost": {"sl_max": 3, "guess": "last"}})
    assert sim["disco-cost"]["guess"] == "last" and sim["disco-cost"]["tokens"] > 0


def test_cli_tune_prices_with_a_profile(tmp_path, capsys):
    """`adaspec disco tune --profile flat`: no forward is timed, no model loaded."""
    data, art = tmp_path / "data.pt", tmp_path / "a.pt"
    DiscoData(samples(2) + samples(2, split="train")).save(data)
    artifact(constant_classifier(0.8)).save(art)
    assert main(["disco", "tune", "--artifact", str(art), "--data", str(data), "--profile",
                 "flat", "--sl-max", "3"]) == 0  # fmt: skip
    tuned = DiscoArtifact.load(art)
    assert tuned.tuning["costs"]["source"] == f"profile:formula:{FLAT_FORMULA}"
    assert tuned.tuning["costs"]["simulated"] is True
    assert "disco-cost" in tuned.tuning["best"]
    assert "cost rule" in capsys.readouterr().err
    ctrl = DiscoLength(tuned, stop="cost", profile=flat())  # the tuned cap is the default
    assert ctrl.sl_max == tuned.tuning["best"]["disco-cost"]["sl_max"]
    assert main(["disco", "tune", "--artifact", str(art), "--data", str(data), "--profile",
                 "flat", "--costs-from", str(art)]) == 2  # fmt: skip
    assert "two sources" in capsys.readouterr().err
    assert main(["disco", "bench", "--data", str(data), "--artifacts", str(art), "--out",
                 str(tmp_path / "b"), "--profile", "flat"]) == 2  # fmt: skip
    assert "add --stop-cost" in capsys.readouterr().err


# ------------------------------------------------------------------- bench and report
def test_bench_arms_and_report_compare_the_cost_rule(tmp_path):
    from adaspec.lab.disco.compare import arms_for
    from adaspec.lab.disco.disco_report import _cost_rule_lines, _mean_of_suites, _scope_table
    from tests.test_bench_report import row

    art = artifact(constant_classifier(0.8))
    art.tuning = {"best": {"static": {"sl_max": 2, "threshold": -1.0},
                           "confidence": {"threshold": 0.5, "sl_max": 3}}}
    art.provenance = {"train_suites": ["he"]}
    assert not any(a.family == "disco-cost" for a in arms_for([("a.pt", art)]))
    arms = arms_for([("a.pt", art)], stop_cost=True, profile="p.json")
    cost_arm = next(a for a in arms if a.family == "disco-cost")
    assert cost_arm.method == "draft:ctrl=disco,disco=a.pt,stop=cost,profile=p.json"
    # decode: plain 6 s, static 4 s, DISCO (tau) 3 s, its cost rule 2 s, for 10 tokens
    decode = {"ar": 6.0, "draft:k=2": 4.0, "draft:ctrl=disco,disco=a.pt": 3.0,
              cost_arm.method: 2.0}
    rows = [row("p", "humaneval", m, s, 10) for m, s in decode.items()]
    t = _scope_table(rows, [a for a in arms if a.method in decode], "he")
    assert t["compare"]["disco_cost"] == cost_arm.label
    assert t["disco_cost_vs_static"] == pytest.approx(2.0 / 4.0)
    assert t["disco_cost_vs_disco"] == pytest.approx(2.0 / 3.0)
    lines = "\n".join(_cost_rule_lines({"humaneval": t}, {}))
    assert "stop=cost" in lines and "| humaneval | -50.0% |" in lines
    plain = _scope_table(rows, [a for a in arms if a.family != "disco-cost"], "he")
    assert "disco_cost" not in plain["compare"] and not _cost_rule_lines({"he": plain}, {})
    assert "decode_disco_cost_vs_static" not in _mean_of_suites({"he (all)": plain}, ["he"])
