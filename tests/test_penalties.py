"""OpenAI's `logit_bias`, `presence_penalty` and `frequency_penalty`, exact under speculation:
each row of the target's pass is shifted by the bias and by the penalties of the output up to
that row (the accepted tokens plus the drafted ones before it), so every method answers
plain decoding's answer under them (greedy) and its law (sampled).

The control: penalties counted over the accepted output only (forgetting the drafted tokens
before a row) part from plain decoding on a tiny model that repeats itself."""

from __future__ import annotations

import itertools

import pytest
import torch

from adaspec.backends.torch.backend import TorchBackend
from adaspec.core.sampling import SamplingParams, argmax, process_logits
from adaspec.errors import InputError
from adaspec.methods.build import build_generator

from .conftest import sampling_backend, tiny_model
from .stats_helpers import assert_exact, fit
from .test_engine import PROMPTS

PARAMS = SamplingParams(logit_bias=((7, 2.5), (11, -100.0)), presence_penalty=0.7,
                        frequency_penalty=1.3)


def reference(model, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """Plain decoding by hand: a whole forward per token, bias and penalties, the argmax."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            logits = logits + params.shift_rows(out, [], logits.shape[-1])[0]
            out.append(int(argmax(logits)))
            ids.append(out[-1])
    return out


@pytest.mark.parametrize("method", ["ar", "ngram:k=4", "draft:k=4"])
def test_greedy_output_under_penalties_is_plain_decodings(method, target, draft,
                                                          target_model):
    engine = build_generator(method, target, None, draft, eos_token_ids=[])
    for prompt in PROMPTS[:3]:
        want = reference(target_model, prompt, 30, PARAMS)
        assert engine.generate(prompt, 30, sampling=PARAMS).token_ids == want, method
    assert 11 not in want  # a -100 bias bans a token
    plain = engine.generate(PROMPTS[0], 30).token_ids
    assert plain != reference(target_model, PROMPTS[0], 30, PARAMS)  # the settings matter


def test_penalties_that_forget_the_draft_are_caught(monkeypatch):
    target_model = tiny_model(seed=5, sharpen=6.0)  # flatter: a penalty moves the argmax
    draft_model = tiny_model(seed=6, layers=1, sharpen=6.0)
    strong = SamplingParams(presence_penalty=2.0, frequency_penalty=2.0)

    def outputs(method: str) -> list[list[int]]:
        engine = build_generator(method, TorchBackend(target_model), None,
                              TorchBackend(draft_model), eos_token_ids=[])
        return [engine.generate(p, 30, sampling=strong).token_ids for p in PROMPTS[:4]]

    want = [reference(target_model, p, 30, strong) for p in PROMPTS[:4]]
    assert outputs("ngram:k=4") == want and outputs("draft:k=4") == want
    real = SamplingParams.shift_rows

    def accepted_only(self, generated, drafted, vocab):
        rows = real(self, generated, [], vocab)
        return rows.repeat(len(drafted) + 1, 1)

    monkeypatch.setattr(SamplingParams, "shift_rows", accepted_only)
    assert outputs("ngram:k=4") != want or outputs("draft:k=4") != want


V = 8
PROMPT = [1, 2, 3]


def exact_law(model, params: SamplingParams) -> torch.Tensor:
    """Plain decoding's law of the first three tokens [V ** 3] under the penalties."""
    law = torch.zeros(V, V, V, dtype=torch.float64)
    with torch.no_grad():
        for a, b in itertools.product(range(V), repeat=2):
            logits = model(torch.tensor([PROMPT + [a, b]])).logits[0, -3:].float()
            rows = torch.stack([logits[0] + params.shift_rows([], [], V)[0],
                                logits[1] + params.shift_rows([a], [], V)[0],
                                logits[2] + params.shift_rows([a, b], [], V)[0]])
            probs = process_logits(rows, params).double()
            law[a, b] = probs[0, a] * probs[1, b] * probs[2]
    return law.flatten()


def test_sampling_under_penalties_follows_plain_decodings_law():
    target_model = tiny_model(vocab=V, seed=5, sharpen=6.0)
    draft_model = tiny_model(vocab=V, seed=6, layers=1, sharpen=6.0)
    params = SamplingParams(1.0, logit_bias=((2, 1.5),), presence_penalty=0.8,
                            frequency_penalty=0.6)
    engine = build_generator("draft:k=3", sampling_backend(target_model), None,
                          sampling_backend(draft_model), eos_token_ids=[])
    runs = 1000
    cells = torch.zeros(runs, dtype=torch.long)
    for seed in range(runs):
        sampling = SamplingParams(1.0, seed=seed, logit_bias=params.logit_bias,
                                  presence_penalty=params.presence_penalty,
                                  frequency_penalty=params.frequency_penalty)
        a, b, c = engine.generate(PROMPT, max_new_tokens=5, sampling=sampling).token_ids[:3]
        cells[seed] = (a * V + b) * V + c
    law = exact_law(target_model, params).view(V * V, V)
    assert_exact([fit(cells // V, law.sum(1)),
                  fit(cells % (V * V), law.view(V, V * V).sum(0))], "penalties")


def test_bad_settings_name_themselves(target):
    for kwargs, match in [({"presence_penalty": 3}, "presence_penalty must be in"),
                          ({"frequency_penalty": -2.5}, "frequency_penalty must be in"),
                          ({"logit_bias": ((1, 101.0),)}, "logit_bias values"),
                          ({"logit_bias": ((-1, 1.0),)}, "logit_bias keys")]:
        with pytest.raises(InputError, match=match):
            SamplingParams(**kwargs)
    engine = build_generator("ar", target, None, None, eos_token_ids=[])
    with pytest.raises(InputError, match="outside the vocabulary"):
        engine.generate([1, 2], 4, sampling=SamplingParams(logit_bias=((10**6, 1.0),)))
