"""The exactness classifier: a divergence at a near-tie of the reference's top two logits is
numerics, anything wider is a bug; the tolerance is the target runtime's own. Both branches
are also reached through the bench runner's comparison."""

from __future__ import annotations

import pytest
import torch

from adaspec.backends.base import ForwardOutput, ModelBackend
from adaspec.control.static import StaticLength
from adaspec.draft.model import ModelDrafter
from adaspec.engine.loop import Engine
from adaspec.lab.bench import exactness
from adaspec.lab.bench import runner as runner_module
from adaspec.lab.bench.exactness import classify, first_difference
from adaspec.lab.bench.runner import BenchConfig, BenchRunner
from adaspec.lab.bench.suites import Prompt
from tests.test_bench_runner import AcceptEverything

BENCH_PROMPTS = [Prompt("t/0", "code", "def add(a, b):"), Prompt("t/1", "code", "for i in x:")]


class GapBackend(ModelBackend):
    """Scores every context with the same logits: token 1 leads token 2 by `gap`."""

    name = "gap"
    vocab_size = 4
    max_context = 64
    num_layers = 1
    hidden_size = 1
    bytes_per_forward = 1

    def __init__(self, gap: float) -> None:
        self.gap = gap
        self.seen: list[list[int]] = []

    @property
    def cache_len(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def forward(self, tokens, positions=None, tree_mask=None, hidden_layer=None):
        self.seen.append([int(t) for t in tokens])
        row = torch.tensor([0.0, 5.0, 5.0 - self.gap, 1.0])
        return ForwardOutput(logits=row.expand(len(tokens), 4).clone())

    def truncate(self, length: int) -> None:
        pass

    def keep(self, indices) -> None:
        pass


@pytest.mark.parametrize(
    "gap, tolerance, kind",
    [(0.01, None, "tie"), (0.125, None, "tie"), (0.3, None, "bug"), (0.3, 0.5, "tie"),
     (2.0, 0.5, "bug")],
)
def test_divergences_are_classified_by_the_reference_gap(gap, tolerance, kind):
    target = GapBackend(gap)  # a torch runtime: bf16's one-ulp tolerance unless given
    div = classify(target, [3, 3], reference=[1, 1, 2, 1], output=[1, 1, 1, 2],
                   tolerance=tolerance)
    assert div is not None and div.index == 2 and div.kind == kind
    assert div.gap == pytest.approx(gap, abs=1e-5)
    assert target.seen[-1] == [3, 3, 1, 1]  # scored the reference's context at that token


def test_equal_outputs_are_not_a_divergence_and_early_stops_are_judged():
    assert classify(GapBackend(3.0), [3], [1, 2], [1, 2]) is None
    assert first_difference([1, 2, 3], [1, 2]) == 2
    div = classify(GapBackend(3.0), [3], [1, 2, 3], [1, 2])  # one stopped early
    assert div is not None and div.index == 2 and div.kind == "bug"


def _broken_run(tmp_path, target, draft, tokenizer, name: str) -> tuple[dict, list[str]]:
    """The bench runner on a method that keeps every drafted token: its output parts from
    plain decoding's, and the runner's comparison classifies where."""
    broken = Engine(target, tokenizer, drafter=ModelDrafter(draft), controller=StaticLength(3),
                    verify=AcceptEverything(), eos_token_ids=[0])
    messages: list[str] = []
    config = BenchConfig(methods=["broken"], max_new_tokens=12, out=str(tmp_path / name))
    runner = BenchRunner(config, target, tokenizer, draft, eos_token_ids=[0],
                         engines={"broken": broken}, progress=False, log=messages.append)
    return runner.run(BENCH_PROMPTS)["exactness"], messages


def test_the_bench_runner_reaches_both_branches(tmp_path, target, draft, tokenizer,
                                               monkeypatch):
    """Through the runner's comparison, not `classify` alone: the same divergences are bugs
    under the target runtime's tolerance when their top-2 gap is wider, ties when it is not."""
    ex, messages = _broken_run(tmp_path, target, draft, tokenizer, "default")
    gaps = [d["gap"] for d in ex["divergences"]]
    assert (ex["differs"], ex["bugs"], ex["numerical_ties"]) == (2, 2, 0)
    assert min(gaps) > exactness.tie_tolerance(target)
    assert sum("BUG" in m for m in messages) == 2

    def runtime_noise(value: float) -> None:
        monkeypatch.setattr(exactness, "tie_tolerance", lambda t: value)
        monkeypatch.setattr(runner_module, "tie_tolerance", lambda t: value)

    runtime_noise(max(gaps))  # a runtime this coarse: each gap is within one ulp
    ex, messages = _broken_run(tmp_path, target, draft, tokenizer, "coarse")
    assert (ex["differs"], ex["bugs"], ex["numerical_ties"]) == (2, 0, 2)
    assert [d["gap"] for d in ex["divergences"]] == pytest.approx(gaps)
    assert sum("numerical tie" in m for m in messages) == 2
    assert not any("BUG" in m for m in messages)

    runtime_noise(min(gaps) - 1e-3)  # just below the narrowest gap: bugs again
    ex, _ = _broken_run(tmp_path, target, draft, tokenizer, "below")
    assert (ex["differs"], ex["bugs"], ex["numerical_ties"]) == (2, 2, 0)


def test_the_tie_tolerance_is_what_the_target_runtime_measures():
    """An ik_llama.cpp target that scores lone tokens and blocks alike (batch_noise 0) has no
    ties at all: any divergence is a bug. Its noisy settings and llama.cpp keep the measured
    0.5; torch bf16 one ulp."""
    from types import SimpleNamespace as Target

    assert exactness.tie_tolerance(Target(kind="ik_llama-native+child", batch_noise=0.0)) == 0
    assert exactness.tie_tolerance(Target(kind="ik_llama-blocks2+child", batch_noise=0.0)) == 0
    assert exactness.tie_tolerance(Target(kind="ik_llama+child", batch_noise=0.75)) == 0.5
    assert exactness.tie_tolerance(Target(kind="llamacpp+child", batch_noise=0.0)) == 0.5
    assert exactness.tie_tolerance(Target(kind="torch", batch_noise=0.0)) == 0.125
