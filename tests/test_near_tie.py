"""Greedy speculation on a runtime whose multi-token pass rounds otherwise than its
single-token pass (llama.cpp's block kernels) still emits what plain decoding emits: rows whose
top-2 gap is within the runtime's batch noise are re-scored alone (Engine._settle_near_tie)."""

from __future__ import annotations

import pytest
import torch

from adaspec.backends.base import ForwardOutput
from adaspec.backends.torch.backend import TorchBackend
from adaspec.core.sampling import top2_gap
from adaspec.methods.build import build_generator

EPS = 0.6  # each logit of a multi-token pass moves by up to this much
PROMPTS = [[5, 9, 13, 2], [17, 3, 3, 3, 40, 41, 8], [1, 2, 3, 4, 5, 6], [33], [60, 1, 60, 1]]


class BlockNoiseBackend(TorchBackend):
    """Every row of a multi-token pass perturbed by up to EPS per logit (a fixed function of
    the row's position, as a kernel's rounding is of its inputs); single-token passes exact."""

    def __init__(self, model, batch_noise: float) -> None:
        super().__init__(model, name="noisy")
        self.batch_noise = batch_noise
        self.multi_rows = 0

    def forward(self, tokens, positions=None, tree_mask=None, hidden_layer=None):
        start = self.cache_len
        out = super().forward(tokens, positions, tree_mask, hidden_layer)
        n = out.logits.shape[0]
        if n == 1:
            return out
        self.multi_rows += n
        noise = torch.stack([
            torch.rand(out.logits.shape[1], generator=torch.Generator().manual_seed(start + i))
            for i in range(n)
        ])
        return ForwardOutput(logits=out.logits + EPS * (2 * noise - 1), hidden=out.hidden)


def outputs(target_model, method: str, batch_noise: float) -> tuple[list[list[int]], int]:
    target = BlockNoiseBackend(target_model, batch_noise)
    draft = TorchBackend(target_model, name="same-as-target")  # always proposes the argmax
    engine = build_generator(method, target, None, draft, eos_token_ids=[])
    results = [engine.generate(p, max_new_tokens=40) for p in PROMPTS]
    return [r.token_ids for r in results], sum(r.stats.rechecks for r in results)


@pytest.mark.parametrize("method", ["draft:k=4", "draft:k=8"])
def test_near_ties_rechecked_alone_give_plain_decoding(target_model, method):
    plain, _ = outputs(target_model, "ar", 2 * EPS)
    got, rechecks = outputs(target_model, method, 2 * EPS)
    assert got == plain
    assert rechecks > 0  # the noise did reach near-ties


def test_without_the_recheck_block_noise_changes_the_output(target_model):
    """Negative control: the same noisy runtime with the recheck off (batch noise 0) parts
    from plain decoding, so the test above depends on the recheck."""
    plain, _ = outputs(target_model, "ar", 0.0)
    got, rechecks = outputs(target_model, "draft:k=4", 0.0)
    assert rechecks == 0
    assert got != plain


def test_plain_decoding_never_rechecks(target_model):
    target = BlockNoiseBackend(target_model, 2 * EPS)
    engine = build_generator("ar", target, None, eos_token_ids=[])
    res = engine.generate(PROMPTS[1], max_new_tokens=20)
    assert res.stats.rechecks == 0
    assert res.stats.target_calls == 20  # the prefill and one call per further token


def test_a_recheck_is_a_target_call_and_keeps_the_cache_consistent(target_model):
    target = BlockNoiseBackend(target_model, 2 * EPS)
    draft = TorchBackend(target_model, name="same-as-target")
    engine = build_generator("draft:k=4", target, None, draft, eos_token_ids=[])
    res = engine.generate(PROMPTS[0], max_new_tokens=30)
    steps = len(res.stats.steps)
    # prefill + one call per step + one per recheck (no step was plain: k > 0 until the end)
    assert res.stats.target_calls == 1 + steps + res.stats.rechecks
    # the cache holds the prompt and every emitted token but the last (not yet fed)
    assert target.cache_len == len(PROMPTS[0]) + len(res.token_ids) - 1


def test_top2_gap():
    x = torch.tensor([[1.0, 3.0, 2.5], [4.0, 4.0, 0.0], [-1.0, -2.0, -5.0]])
    assert torch.allclose(top2_gap(x), torch.tensor([0.5, 0.0, 1.0]))
