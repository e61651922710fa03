"""The torch backend: KV-cache rollback, tree attention, compaction, hidden states."""

from __future__ import annotations

import pytest
import torch

from adaspec.backends.torch.backend import TorchBackend


@pytest.fixture
def target(runtime_target):
    """Every test here runs on each torch runtime (tests/conftest.py)."""
    return runtime_target


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_prefill_scores_only_the_last_row(target, target_model):
    ids = list(range(3, 23))
    out = target.prefill(torch.tensor(ids))
    assert out.logits.shape == (1, target.vocab_size)
    torch.testing.assert_close(out.logits, full_logits(target_model, ids)[-1:])
    assert target.cache_len == len(ids)  # every row still went into the cache
    # no autograd graph: the prompt's activations are not kept alive while decoding
    assert any(p.requires_grad for p in target_model.parameters())
    assert not out.logits.requires_grad and not out.logits.grad_fn
    hidden = target.prefill(torch.tensor(ids), hidden_layer=1).hidden
    assert hidden is not None and not hidden.requires_grad


def test_truncate_and_refeed_equals_fresh_prefill(target, target_model):
    ids = list(range(3, 23))
    target.prefill(torch.tensor(ids[:15]))
    target.forward(torch.tensor([60, 61, 62]))  # a rejected draft
    assert target.cache_len == 18
    target.truncate(15)
    assert target.cache_len == 15
    refed = target.forward(torch.tensor(ids[15:])).logits
    fresh = TorchBackend(target_model).forward(torch.tensor(ids)).logits[15:]
    torch.testing.assert_close(refed, fresh, rtol=1e-5, atol=1e-5)


def test_tree_mask_scores_each_node_as_its_own_path(target, target_model):
    prefix = [5, 9, 13, 2, 7]
    # nodes: a, b (siblings at depth 1), c (child of a), d (child of c), e (child of b)
    tokens = [11, 12, 21, 31, 41]
    parents = [-1, -1, 0, 2, 1]
    depth = [1, 1, 2, 3, 2]
    n = len(tokens)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    target.prefill(torch.tensor(prefix))
    out = target.forward(
        torch.tensor(tokens), torch.tensor([len(prefix) - 1 + d for d in depth]), tree_mask=mask
    ).logits
    for i in range(n):
        path, j = [], i
        while j != -1:
            path.insert(0, tokens[j])
            j = parents[j]
        expected = full_logits(target_model, prefix + path)[-1]
        torch.testing.assert_close(out[i], expected, rtol=1e-4, atol=1e-4)


def test_keep_compacts_to_accepted_path(target, target_model):
    prefix = [5, 9, 13, 2, 7]
    tokens = [11, 12, 21]  # a, b, c (child of a)
    mask = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)
    target.prefill(torch.tensor(prefix))
    target.forward(torch.tensor(tokens), torch.tensor([5, 5, 6]), tree_mask=mask)
    target.keep(torch.tensor([0, 1, 2, 3, 4, 5, 7]))  # prefix + a + c
    assert target.cache_len == 7
    nxt = target.forward(torch.tensor([33])).logits[-1]
    torch.testing.assert_close(
        nxt, full_logits(target_model, prefix + [11, 21, 33])[-1], rtol=1e-4, atol=1e-4
    )


def test_hidden_state_at_a_chosen_layer(target, target_model):
    ids = torch.tensor([4, 8, 15, 16])
    out = target.prefill(ids, hidden_layer=1)
    with torch.no_grad():
        ref = target_model(ids[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.hidden, ref[1][0])
    last = target.prefill(ids, hidden_layer=target.num_layers).hidden
    torch.testing.assert_close(last, ref[-1][0])


def test_weight_bytes_exclude_input_embedding(target, target_model):
    emb = target_model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in target_model.parameters())
    assert target.bytes_per_forward == total - emb.numel() * emb.element_size()
