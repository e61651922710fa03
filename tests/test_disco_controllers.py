"""The dynamic length controllers in the engine on tiny fp32 models: DISCO stops where its
classifier says (a static length would not), greedy output stays exact, the features it reads
equal the collected ones; the confidence rule; the oracle in the bench."""

from __future__ import annotations

import copy

import pytest
import torch

from adaspec.backends.torch.backend import TorchBackend
from adaspec.control.confidence import ConfidenceLength
from adaspec.control.cursor import GenerationCursor
from adaspec.control.disco import DiscoLength
from adaspec.control.disco_features import assemble, distribution_features
from adaspec.engine.loop import Engine
from adaspec.errors import InputError
from adaspec.lab.bench.oracle import OracleLength
from adaspec.lab.bench.runner import BenchConfig, BenchRunner
from adaspec.lab.bench.suites import Prompt
from adaspec.lab.bench.theory import oracle_schedule, teacher_forced_hits, teacher_forced_logits
from adaspec.methods.build import build_generator
from tests.disco_helpers import SPEC, artifact, constant_classifier, stop_at_position
from tests.test_engine import PROMPTS, reference_greedy


def disco_engine(target, draft, classifier, tau=0.5, sl_max=6, tmp_path=None):
    ctrl = DiscoLength(artifact(classifier, tau=tau, sl_max=sl_max))
    from adaspec.draft.model import ModelDrafter

    return Engine(target, None, ModelDrafter(draft), ctrl, eos_token_ids=[])


@pytest.mark.parametrize("n", [1, 3])
def test_disco_stops_where_the_classifier_says(target_model, n):
    """The target as its own draft accepts everything, so only the controller can end a draft
    early: DISCO drafts n tokens per step; a static length (sl_max) would draft 6."""
    twin = TorchBackend(copy.deepcopy(target_model))
    engine = disco_engine(TorchBackend(target_model), twin, stop_at_position(n), sl_max=6)
    res = engine.generate(PROMPTS[0], max_new_tokens=30)
    drafted = [d for d, _ in res.stats.steps]
    assert drafted[:-1] == [n] * (len(drafted) - 1)  # the last step may be cut by the budget
    static = build_generator("draft:k=6", TorchBackend(target_model), None, twin, eos_token_ids=[])
    static_drafted = [d for d, _ in static.generate(PROMPTS[0], max_new_tokens=30).stats.steps]
    assert static_drafted != drafted


@pytest.mark.parametrize("p_accept,expected", [(0.2, 1), (0.9, 5)])
def test_disco_constant_classifier_gives_one_or_sl_max(target_model, p_accept, expected):
    twin = TorchBackend(copy.deepcopy(target_model))
    engine = disco_engine(TorchBackend(target_model), twin, constant_classifier(p_accept), sl_max=5)
    steps = engine.generate(PROMPTS[1], max_new_tokens=25).stats.steps
    assert {d for d, _ in steps[:-1]} == {expected}


@pytest.mark.parametrize("classifier", [constant_classifier(0.9), stop_at_position(2)])
def test_disco_greedy_equals_plain_decoding(target, draft, target_model, classifier):
    engine = disco_engine(target, draft, classifier, sl_max=4)
    for prompt in PROMPTS:
        res = engine.generate(prompt, max_new_tokens=30)
        assert res.token_ids == reference_greedy(target_model, prompt, 30)


def test_disco_reads_the_collected_features(target_model):
    """The row the controller classifies equals the row collection builds from a
    teacher-forced pass at the same generation index and draft position."""
    twin = TorchBackend(copy.deepcopy(target_model))
    engine = disco_engine(TorchBackend(target_model), twin, stop_at_position(3), sl_max=6)
    seen: list[torch.Tensor] = []
    clf = engine.controller.artifact.classifier
    real = clf.accept_probability
    clf.accept_probability = lambda x: (seen.append(x.clone()), real(x))[1]
    res = engine.generate(PROMPTS[2], max_new_tokens=20)
    logits = teacher_forced_logits(TorchBackend(target_model), res.prompt_ids, res.token_ids)
    dist = distribution_features(logits)
    expected = []
    g = 1
    for drafted, accepted in res.stats.steps:
        for d in range(drafted):
            expected.append(assemble(dist[g + d], d, g + d, SPEC))
        g += accepted + 1
    assert len(seen) == len(expected) > 5
    for got, want in zip(seen, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_disco_refuses_another_pair(target, draft, tmp_path):
    path = tmp_path / "a.pt"
    artifact(constant_classifier(0.9), target="other-target").save(path)
    with pytest.raises(InputError, match="trained for draft"):
        build_generator(f"draft:ctrl=disco,disco={path}", target, None, draft)
    artifact(constant_classifier(0.9)).save(path)
    engine = build_generator(
        f"draft:ctrl=disco,disco={path},threshold=0.3,sl_max=2", target, None, draft
    )
    assert (engine.controller.tau, engine.controller.sl_max) == (0.3, 2)


P_ACCEPT = 0.6  # what constant_classifier(P_ACCEPT) says after every drafted token


@pytest.mark.parametrize(
    "artifact_tau, threshold, keeps",
    [(0.5, 0.7, False), (0.7, 0.5, True), (0.5, 0.61, False), (0.7, 0.59, True)],
)
def test_disco_threshold_overrides_the_artifacts_tau(
    tmp_path, target_model, artifact_tau, threshold, keeps
):
    """The acceptance probability (0.6) lies between the artifact's tau and `threshold=`:
    the override decides, on either side of the boundary. Reading the artifact's tau
    instead would flip every decision here."""
    path = tmp_path / "disco.pt"
    artifact(constant_classifier(P_ACCEPT), tau=artifact_tau, sl_max=5).save(path)
    direct = DiscoLength.from_file(str(path), tau=threshold)
    direct.begin()
    direct.max_tokens()
    logits = torch.randn(64)
    assert direct.keep_drafting(0, logits) is keeps
    assert direct.last_probability == pytest.approx(P_ACCEPT, abs=1e-5)
    # no override: the artifact's tau decides, the other way
    assert DiscoLength.from_file(str(path)).keep_drafting(0, logits) is (not keeps)

    # Through a built engine; the target as its own draft accepts everything, so only the
    # controller ends a draft: every step but the budget-cut last drafts one token when it
    # stops, SL_max when it keeps on.
    target = TorchBackend(target_model, name="tiny-target")
    twin = TorchBackend(copy.deepcopy(target_model), name="tiny-draft")
    engine = build_generator(
        f"draft:ctrl=disco,disco={path},threshold={threshold}", target, None, twin, []
    )
    steps = engine.generate(PROMPTS[1], max_new_tokens=25).stats.steps
    assert len(steps) > 2
    assert {d for d, _ in steps[:-1]} == {5 if keeps else 1}


def test_confidence_rule():
    c = ConfidenceLength(threshold=0.5, k=7)
    assert c.max_tokens() == 7
    assert c.keep_drafting(0, torch.tensor([4.0, 0.0, 0.0]))  # top probability ~0.96
    assert not c.keep_drafting(0, torch.tensor([0.1, 0.0, 0.0]))  # ~0.36
    with pytest.raises(InputError):
        ConfidenceLength(threshold=1.5)
    with pytest.raises(InputError):
        c.keep_drafting(0, None)


def test_confidence_greedy_equals_plain_decoding(target, draft, target_model):
    engine = build_generator("draft:ctrl=confidence,threshold=0.6,k=5", target, None, draft, [])
    res = engine.generate(PROMPTS[1], max_new_tokens=30)
    assert res.token_ids == reference_greedy(target_model, PROMPTS[1], 30)
    assert max(d for d, _ in res.stats.steps) <= 5


def test_cursor_counts_steps_without_a_draft():
    c = GenerationCursor()
    assert c.begin_step() == 1
    c.end_step(2)  # 2 accepted + the target's token
    assert c.begin_step() == 4
    assert c.begin_step() == 5  # the step before drafted nothing: one token
    c.begin()
    assert c.begin_step() == 1


def test_oracle_schedule_from_hits():
    o = OracleLength(k_max=3)
    with pytest.raises(InputError, match="reference output"):
        o.begin()
    o.set_hits([True, True, False, False, True, True, True, True, True])
    o.begin()
    assert o.max_tokens() == 1  # token 1 hits, 2 misses (the target's correction)
    o.update(1, 1)
    assert o.max_tokens() == 0  # token 3 misses too: the target decodes it alone
    assert o.max_tokens() == 3  # tokens 4.. hit, capped at k_max


def test_oracle_in_the_bench_drafts_only_accepted_tokens(tmp_path, target, draft, tokenizer):
    prompts = [Prompt("t/0", "code", "def add(a, b):"), Prompt("t/1", "code", "for i in x:")]
    config = BenchConfig(
        methods=["draft:ctrl=oracle", "draft:k=3"], max_new_tokens=16, out=str(tmp_path)
    )
    runner = BenchRunner(config, target, tokenizer, draft, eos_token_ids=[0], progress=False)
    summary = runner.run(prompts)
    by = {(r["prompt_id"], r["method"]): r for r in runner.rows}
    for p in prompts:
        row, ar = by[(p.id, "draft:ctrl=oracle")], by[(p.id, "ar")]
        assert row["token_ids"] == ar["token_ids"]
        assert row["accepted"] == row["drafted"] == row["draft_calls"]
        ids = runner.turn_prompt_ids(p, [])
        sched = oracle_schedule(teacher_forced_hits(draft, ids, ar["token_ids"]))
        assert [d for d, _ in row["steps"]] == [s for s in sched["steps"] if s]
    assert summary["exactness"]["differs"] == 0


def test_oracle_needs_greedy(tmp_path, target, draft, tokenizer):
    config = BenchConfig(
        methods=["draft:ctrl=oracle"], max_new_tokens=4, temperature=1.0, out=str(tmp_path)
    )
    runner = BenchRunner(config, target, tokenizer, draft, eos_token_ids=[0], progress=False)
    with pytest.raises(InputError, match="greedy"):
        runner.run([Prompt("t/0", "code", "abc")])


def test_dynamic_controllers_need_the_draft_model():
    from adaspec.methods.spec import parse_method

    for ctrl in ("confidence", "disco", "oracle"):
        with pytest.raises(InputError, match="needs the draft model"):
            parse_method(f"ngram:ctrl={ctrl}")
