"""Log-probabilities of the emitted tokens, read from the pass that chose them: for every
method the target's own log-softmax at each emitted token's position (recomputed here
without a cache), with the top alternatives; above temperature 0 the processed
distribution's. A step that accepts a draft must not hand back another row's numbers."""

from __future__ import annotations

import math

import pytest
import torch

from adaspec.backends.torch.backend import TorchBackend
from adaspec.core.sampling import SamplingParams, process_logits
from adaspec.engine.steps import StreamChunk
from adaspec.errors import InputError
from adaspec.methods.build import build_generator

from .test_engine import PROMPTS, NegatedBackend


def reference_rows(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: the logits that predict each token, no cache, one pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def run(engine, prompt, n, sampling):
    chunks = [item for item in engine.stream(prompt, max_new_tokens=n, sampling=sampling)]
    result = chunks[-1]
    streamed = [lp for c in chunks if isinstance(c, StreamChunk) for lp in c.logprobs]
    return result, streamed


@pytest.mark.parametrize("method,draft", [("ar", None), ("draft:k=3", "same"),
                                          ("draft:k=2", "negated"), ("ngram", None),
                                          ("draft:tree=2x2x1", "same")])
def test_greedy_logprobs_are_the_targets_at_every_emitted_token(target_model, method, draft):
    drafts = {"same": lambda: TorchBackend(target_model),
              "negated": lambda: NegatedBackend(target_model), None: lambda: None}
    engine = build_generator(method, TorchBackend(target_model), None, drafts[draft](),
                          eos_token_ids=[])
    prompt = PROMPTS[1]
    result, streamed = run(engine, prompt, 12, SamplingParams(logprobs=3))
    assert result.logprobs == streamed and len(result.logprobs) == len(result.token_ids)
    reference = torch.log_softmax(reference_rows(target_model, prompt, result.token_ids), -1)
    for i, (tok, lp) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
        assert lp.token == tok
        assert lp.logprob == pytest.approx(float(reference[i, tok]), abs=1e-4)
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy: the emitted is the top
        values, ids = torch.topk(reference[i], 3)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_sampled_logprobs_are_the_processed_distributions(target_model):
    sampling = SamplingParams(temperature=0.7, top_k=5, seed=3, logprobs=8)
    engine = build_generator("draft:k=3", TorchBackend(target_model), None,
                          TorchBackend(target_model), eos_token_ids=[])
    result, _ = run(engine, PROMPTS[0], 10, sampling)
    processed = process_logits(reference_rows(target_model, PROMPTS[0], result.token_ids),
                               sampling)
    for i, lp in enumerate(result.logprobs):
        assert math.isfinite(lp.logprob)
        assert math.exp(lp.logprob) == pytest.approx(float(processed[i, lp.token]), abs=1e-4)
        assert len(lp.top) == 5  # top_k removed the rest: no -inf alternatives listed
        assert sum(math.exp(v) for _, v in lp.top) == pytest.approx(1.0, abs=1e-4)


def test_no_logprobs_unless_asked_and_the_bound(target_model):
    engine = build_generator("ar", TorchBackend(target_model), None, None, eos_token_ids=[])
    result, streamed = run(engine, PROMPTS[0], 4, SamplingParams())
    assert result.logprobs is None and streamed == []
    result, _ = run(engine, PROMPTS[0], 4, SamplingParams(logprobs=0))
    assert [lp.top for lp in result.logprobs] == [()] * 4
    for bad in (21, -1, 2.5, True):
        with pytest.raises(InputError, match="top logprobs must be an integer in"):
            SamplingParams(logprobs=bad)
