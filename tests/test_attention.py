"""Row-invariant attention: a block scores bit-for-bit what one-token decoding scores."""

from __future__ import annotations

import pytest
import torch

from adaspec.backends.torch.attention import ROW_INVARIANT, visible_keys
from adaspec.backends.torch.backend import TorchBackend
from adaspec.core.sampling import SamplingParams
from adaspec.methods.build import build_generator
from adaspec.store.quant import quantize_model
from tests.conftest import CharTokenizer, tiny_model

PROMPT = [5, 9, 13, 2, 7, 30, 31, 8, 4, 19, 22]


def quantized_backend(mode: str, row_invariant: bool, seed: int = 3) -> TorchBackend:
    model = tiny_model(vocab=64, hidden=128, layers=2, seed=seed)
    quantize_model(model, mode)
    return TorchBackend(model, row_invariant=row_invariant)


def one_at_a_time(backend: TorchBackend, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    backend.prefill(torch.tensor(prefix))
    return torch.cat([backend.forward(torch.tensor([t])).logits for t in tokens])


def test_visible_keys_are_prefixes_for_a_causal_block():
    assert visible_keys(None, 3, 10) == [slice(0, 8), slice(0, 9), slice(0, 10)]


def test_visible_keys_gather_tree_rows_and_read_additive_masks():
    allowed = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 1, 0, 1]], dtype=torch.bool)
    plan = visible_keys(allowed[None, None], 3, 5)
    assert plan[0] == slice(0, 3)
    assert plan[1].tolist() == [0, 1, 3]
    assert plan[2].tolist() == [0, 1, 2, 4]
    additive = torch.where(allowed, 0.0, float("-inf"))[None, None]
    assert [p if isinstance(p, slice) else p.tolist() for p in visible_keys(additive, 3, 5)] == [
        slice(0, 3), [0, 1, 3], [0, 1, 2, 4]
    ]


def test_a_row_that_sees_nothing_is_an_error():
    with pytest.raises(ValueError, match="row 1 sees no key"):
        visible_keys(torch.tensor([[[[True, False], [False, False]]]]), 2, 2)


@pytest.mark.parametrize("mode", ["int8", "int4", "int8-dyn"])
def test_a_chain_block_is_bit_identical_to_decoding_it(mode):
    backend = quantized_backend(mode, row_invariant=True)
    assert backend.model.config._attn_implementation == ROW_INVARIANT
    block = [11, 40, 12, 3, 50, 21, 7, 9]
    alone = one_at_a_time(backend, PROMPT, block)
    backend.prefill(torch.tensor(PROMPT))
    together = backend.forward(torch.tensor(block)).logits
    assert torch.equal(together, alone)


def test_tree_nodes_are_bit_identical_to_decoding_their_paths():
    backend = quantized_backend("int8-dyn", row_invariant=True)
    tokens = [11, 12, 21, 31, 41]  # a, b siblings; c child of a; d child of c; e child of b
    parents = [-1, -1, 0, 2, 1]
    depth = [1, 1, 2, 3, 2]
    mask = torch.zeros(5, 5, dtype=torch.bool)
    for i in range(5):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    backend.prefill(torch.tensor(PROMPT))
    positions = torch.tensor([len(PROMPT) - 1 + d for d in depth])
    tree = backend.forward(torch.tensor(tokens), positions, tree_mask=mask).logits
    for leaf in (3, 4):
        path, j = [], leaf
        while j != -1:
            path.insert(0, j)
            j = parents[j]
        alone = one_at_a_time(backend, PROMPT, [tokens[j] for j in path])
        assert torch.equal(tree[path], alone)


def test_prefill_keeps_the_batched_kernel():
    """The prompt is scored as before (plain and speculative decoding share it)."""
    fast = quantized_backend("int8-dyn", row_invariant=False)
    invariant = quantized_backend("int8-dyn", row_invariant=True)
    got = invariant.prefill(torch.tensor(PROMPT)).logits
    assert torch.equal(got, fast.prefill(torch.tensor(PROMPT)).logits)


def test_a_second_backend_over_the_same_model_keeps_batched_attention():
    """Row invariance is the backend's switch: a plain backend over a model that a
    row-invariant backend also drives scores a block as the untouched model does."""
    invariant = quantized_backend("int8-dyn", row_invariant=True)
    shared = TorchBackend(invariant.model)
    untouched = quantized_backend("int8-dyn", row_invariant=False)
    block = [11, 40, 12, 3, 50, 21, 7, 9]
    got = {}
    for name, backend in (("invariant", invariant), ("shared", shared), ("batched", untouched)):
        backend.prefill(torch.tensor(PROMPT))
        got[name] = backend.forward(torch.tensor(block)).logits
    assert torch.equal(got["shared"], got["batched"])
    assert not torch.equal(got["invariant"], got["batched"])  # the two paths really differ


@pytest.mark.parametrize("method", ["draft:k=5", "draft:tree=3x2x1", "ngram:k=6"])
def test_greedy_speculation_on_a_quantized_target_repeats_plain_decoding_bit_for_bit(method):
    """End to end through the engine: chains, trees and n-gram drafts over a row-invariant
    quantized target emit plain decoding's tokens in fewer target calls."""
    tok = CharTokenizer()
    target = quantized_backend("int8-dyn", row_invariant=True, seed=5)
    draft = TorchBackend(tiny_model(vocab=64, hidden=128, layers=2, seed=5))  # float weights
    prompt = "def fibonacci(n):\n    if n < 2:\n"
    plain = build_generator("ar", target, tok, None, eos_token_ids=[])
    spec = build_generator(method, target, tok, draft, eos_token_ids=[])
    greedy = SamplingParams(temperature=0.0)
    want = plain.generate(prompt, max_new_tokens=40, sampling=greedy)
    got = spec.generate(prompt, max_new_tokens=40, sampling=greedy)
    assert got.token_ids == want.token_ids
    assert got.stats.target_calls < want.stats.target_calls


def test_sliding_window_models_keep_batched_attention():
    """The row path reads no sliding-window mask: such a model is refused, and the loader
    leaves it on batched attention (with the tie rule) instead of scoring it wrongly."""
    from adaspec.backends.torch.attention import (
        row_invariance_supported,
        use_row_invariant_attention,
    )

    model = tiny_model(vocab=64, hidden=32, layers=2)
    assert row_invariance_supported(model)
    model.config.use_sliding_window, model.config.sliding_window = True, 4
    assert not row_invariance_supported(model)
    with pytest.raises(ValueError, match="sliding-window"):
        use_row_invariant_attention(model)
