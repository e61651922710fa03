"""The restricted draft head: logits equal the full head's on the set and are -inf elsewhere,
the drafter never proposes outside the set, the method string really applies it, and the
output stays exact (greedy equality, and the target's distribution at T > 0)."""

from __future__ import annotations

import pytest
import torch

from adaspec.backends.torch.backend import TorchBackend
from adaspec.backends.torch.restricted_head import RestrictedHeadBackend, restrict_head
from adaspec.core.request import RequestState
from adaspec.core.sampling import SamplingParams
from adaspec.draft.model import ModelDrafter
from adaspec.errors import InputError, ModelStoreError
from adaspec.methods.build import build_generator
from adaspec.methods.spec import parse_method
from adaspec.store.token_set import TokenSet, save_token_set

from .conftest import sampling_backend, tiny_model
from .stats_helpers import assert_exact
from .test_engine_sampling import V, check, first_tokens

KEEP = (0, 3, 5, 7, 11, 12, 20, 33, 40, 41, 50, 63)
PROMPT = [3, 4, 5, 6]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))


def test_logits_match_the_full_head_on_the_set(draft_model):
    full = TorchBackend(draft_model, name="d")
    small = restrict_head(full, KEEP)
    assert small.vocab_size == full.vocab_size == 64 and small.name == "d"
    assert small.bytes_per_forward < full.bytes_per_forward
    assert small.model.head.weight.shape == (len(KEEP), draft_model.config.hidden_size)
    ids = torch.tensor(PROMPT)
    ref = full.prefill(ids, hidden_layer=1)
    out = small.prefill(ids, hidden_layer=1)
    keep = torch.tensor(KEEP)
    torch.testing.assert_close(out.logits[:, keep], ref.logits[:, keep])
    outside = torch.ones(64, dtype=torch.bool)
    outside[keep] = False
    assert bool(torch.isneginf(out.logits[:, outside]).all())
    torch.testing.assert_close(out.hidden, ref.hidden)
    # the cache works as before: one more token after the prompt
    nxt = torch.tensor([9])
    torch.testing.assert_close(
        small.forward(nxt).logits[:, keep], full.forward(nxt).logits[:, keep]
    )


def test_drafter_never_proposes_outside_the_set(draft_model):
    drafter = ModelDrafter(restrict_head(TorchBackend(draft_model), KEEP))
    ctrl = build_generator("draft:k=6", TorchBackend(draft_model), None, TorchBackend(draft_model))
    for params in (SamplingParams(), SamplingParams(1.0, seed=1), SamplingParams(2.0, seed=2)):
        gen = params.generator()
        drafter.begin(RequestState.of(PROMPT))
        prop = drafter.propose(RequestState.of(PROMPT, params, gen), 6, ctrl.controller)
        assert set(prop.tokens) <= set(KEEP)
        if prop.probs is not None:
            outside = [t for t in range(64) if t not in KEEP]
            assert float(prop.probs[:, outside].sum()) == 0.0
            torch.testing.assert_close(prop.probs.sum(-1), torch.ones(len(prop.tokens)))


def test_method_string_applies_the_stored_set(target, draft, tokenizer):
    with pytest.raises(ModelStoreError, match="restrict-vocab --draft tiny-draft --top 12"):
        build_generator("draft:k=3,vocab=12", target, tokenizer, draft, [0])
    save_token_set(TokenSet("tiny-draft", KEEP))
    engine = build_generator("draft:k=3,vocab=12", target, tokenizer, draft, [0])
    backend = engine.drafter.backend
    assert isinstance(backend, RestrictedHeadBackend)
    assert backend.token_ids.tolist() == list(KEEP)
    full = build_generator("draft:k=3", target, tokenizer, draft, [0])
    assert not isinstance(full.drafter.backend, RestrictedHeadBackend)
    tree = build_generator("draft:tree=2x2,vocab=12", target, tokenizer, draft, [0])
    assert isinstance(tree.drafter.backend, RestrictedHeadBackend)
    with pytest.raises(InputError, match="vocab must be >= 0"):
        parse_method("draft:vocab=-1")
    with pytest.raises(InputError, match="no parameter 'vocab'"):
        parse_method("ngram:vocab=5")


def test_greedy_output_equals_plain_decoding(target, draft, tokenizer):
    save_token_set(TokenSet("tiny-draft", KEEP))
    ar = build_generator("ar", target, tokenizer, None, [0]).generate(PROMPT, 24)
    res = build_generator("draft:k=3,vocab=12", target, tokenizer, draft, [0]).generate(PROMPT, 24)
    assert res.token_ids == ar.token_ids
    assert res.stats.drafted > 0


def test_restriction_is_exact_at_temperature_above_zero():
    """The target's distribution of generated tokens 2 and 3 (speculative step, k = 2) with a
    draft whose head keeps half the vocabulary: q is zero on the rest."""
    target_model = tiny_model(vocab=V, seed=5, sharpen=6.0)
    draft_model = tiny_model(vocab=V, seed=6, layers=1, sharpen=6.0)
    keep = (0, 2, 3, 6)
    save_token_set(TokenSet("half", keep))
    engine = build_generator(
        "draft:k=2,vocab=4", sampling_backend(target_model), None,
        TorchBackend(draft_model, name="half"), [],
    )
    params = SamplingParams(1.0)
    cells, acceptance = first_tokens(engine, params, max_new_tokens=4)
    assert 0.05 < acceptance < 0.95
    assert_exact(check(cells, target_model, params), "restricted head")
    # tokens outside the set are still emitted (through the correction): nothing is lost
    second = (cells // V) % V
    share = sum(int((second == t).sum()) for t in range(V) if t not in keep) / len(cells)
    assert share > 0.05


def test_restrict_needs_a_torch_backend(draft):
    with pytest.raises(InputError, match="torch draft"):
        restrict_head(object(), KEEP)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="already restricted"):
        restrict_head(restrict_head(draft, KEEP), KEEP)
    with pytest.raises(InputError, match="non-empty ids"):
        restrict_head(draft, [64])
