"""Token trees: branching configs, layout, masks and positions; the tree drafter's level by
level expansion (its distributions equal plain-sequence ones) and its cache compaction."""

from __future__ import annotations

import pytest
import torch

from adaspec.backends.torch.backend import TorchBackend
from adaspec.control.static import StaticLength
from adaspec.core.request import RequestState
from adaspec.core.sampling import SamplingParams
from adaspec.core.token_tree import TokenTree, parse_branching, tree_node_count
from adaspec.draft.model_tree import ModelTreeDrafter, draw_children
from adaspec.errors import InputError
from adaspec.methods.build import build_generator
from adaspec.methods.spec import parse_method

from .test_torch_backend import full_logits
from .test_verify import tv, tv_bound


@pytest.mark.parametrize(
    ("text", "factors", "nodes"),
    [
        ("4x2x2x1", (4, 2, 2, 1), 44),
        ("8x2x1", (8, 2, 1), 40),
        ("2x2x2x1", (2, 2, 2, 1), 22),
        ("16x1", (16, 1), 32),
        (" 1X1x1 ", (1, 1, 1), 3),
        ("5", (5,), 5),
    ],
)
def test_branching_configs(text, factors, nodes):
    assert parse_branching(text) == factors
    assert tree_node_count(factors) == nodes


@pytest.mark.parametrize(
    ("text", "kwargs", "message"),
    [
        ("", {}, "tree config is empty"),
        ("4x", {}, "'' is not a positive integer"),
        ("4x-2", {}, "'-2' is not a positive integer"),
        ("4*2", {}, "'4\\*2' is not a positive integer"),
        ("2.5x2", {}, "'2.5' is not a positive integer"),
        ("0x3", {}, "must be >= 1"),
        ("16x16", {}, "272 nodes \\(budget 256 paths\\), over the limit of 64 nodes"),
        ("4x2x2x1", {"max_nodes": 40}, "44 nodes .* limit of 40 nodes"),
    ],
)
def test_bad_branching_configs_name_the_problem(text, kwargs, message):
    with pytest.raises(InputError, match=message):
        parse_branching(text, **kwargs)


def test_tree_layout_mask_positions_paths():
    # root r; a, b at depth 1; c, d under a; e under b; f under c
    tree = TokenTree.root(7)
    tree.add_level([0, 0], [11, 12])
    tree.add_level([1, 1, 2], [21, 22, 23])
    tree.add_level([3], [31])
    assert tree.depths == [0, 1, 1, 2, 2, 2, 3] and tree.depth == 3 and tree.drafted == 6
    assert tree.children == [[1, 2], [3, 4], [5], [6], [], [], []]
    assert tree.path(6) == [1, 3, 6] and tree.path_tokens(6) == [11, 21, 31]
    assert tree.level(2) == [3, 4, 5]
    tokens, positions, mask = tree.flatten(root_position=10)
    assert tokens.tolist() == [7, 11, 12, 21, 22, 23, 31]
    assert positions.tolist() == [10, 11, 11, 12, 12, 12, 13]
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for i in range(7):
        for j in [0, *tree.path(i)]:
            expected[i, j] = True
    assert torch.equal(mask, expected)
    assert TokenTree([1, 2, 3], [-1, 0, 1]).is_chain() and not tree.is_chain()
    with pytest.raises(ValueError, match="parent"):
        TokenTree([1, 2], [-1, 1])
    with pytest.raises(ValueError, match="level order"):
        TokenTree([1, 2, 3, 4], [-1, 0, 1, 0])


def test_flattened_tree_scores_each_node_as_its_path(target, target_model):
    prefix = [5, 9, 13, 2, 7]
    g = torch.Generator().manual_seed(0)
    tree = TokenTree.root(prefix[-1])
    frontier = [0]
    for b in (3, 2, 1):
        parents = [par for par in frontier for _ in range(b)]
        frontier = tree.add_level(parents, torch.randint(64, (len(parents),), generator=g).tolist())
    target.prefill(torch.tensor(prefix[:-1]))
    logits = target.forward(*tree.flatten(len(prefix) - 1)).logits
    for i in range(len(tree)):
        expected = full_logits(target_model, prefix + tree.path_tokens(i))[-1]
        torch.testing.assert_close(logits[i], expected, rtol=1e-4, atol=1e-4)


def cached_kv(backend) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer the keys and values a torch runtime holds for its cached tokens."""
    if hasattr(backend, "_layers"):  # transformers' dynamic cache
        return [(layer.keys, layer.values) for layer in backend._layers()]
    n = backend.cache_len  # the static runtime: the first cache_len slots
    return [(k[:, :, :n], v[:, :, :n]) for k, v in backend._cache]


def cache_equals_prefill(backend, model, tokens: list[int]) -> None:
    fresh = TorchBackend(model)
    fresh.prefill(torch.tensor(tokens))
    assert backend.cache_len == len(tokens)
    for got, want in zip(cached_kv(backend), cached_kv(fresh), strict=True):
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("replacement", [True, False])
def test_draft_levels_see_only_their_ancestors(draft, draft_model, replacement):
    """q rows from the level-by-level expansion equal the draft's plain-sequence
    distributions; then the cache compacts to the context plus the accepted path."""
    context = [3, 1, 4, 1, 5, 9]
    drafter = ModelTreeDrafter(draft, (3, 2, 2))
    drafter.begin(RequestState.of(context))
    params = SamplingParams(1.0)
    generator = torch.Generator().manual_seed(1)
    proposal = drafter.propose(RequestState.of(context, params, generator, replacement),
                               3, StaticLength(3))
    tree = proposal.tree
    assert proposal.forward_calls == 3 and len(tree) == 1 + 3 + 6 + 12
    assert proposal.probs is not None and proposal.probs.shape[0] == 1 + 3 + 6
    for i in range(proposal.probs.shape[0]):
        plain = full_logits(draft_model, context + tree.path_tokens(i))[-1].softmax(-1)
        torch.testing.assert_close(proposal.probs[i], plain, rtol=1e-4, atol=1e-5)
        kids = [tree.tokens[c] for c in tree.children[i]]
        if not replacement:
            assert len(set(kids)) == len(kids)
    path = tree.path(len(tree) - 2)  # a non-prefix path through all levels
    accepted = tree.path_tokens(path[-1])
    drafter.commit(RequestState.of(context + accepted), path)
    assert drafter.cached_tokens == context + accepted[:-1]  # the leaf was never fed
    cache_equals_prefill(draft, draft_model, context + accepted[:-1])


def test_greedy_draft_takes_top_k_distinct(draft, draft_model):
    context = [8, 6, 7, 5, 3, 0, 9]
    drafter = ModelTreeDrafter(draft, (4, 2))
    drafter.begin(RequestState.of(context))
    proposal = drafter.propose(RequestState.of(context, SamplingParams(), None, True),
                               2, StaticLength(2))
    tree = proposal.tree
    assert proposal.probs is None
    for i in [0, *tree.level(1)]:
        plain = full_logits(draft_model, context + tree.path_tokens(i))[-1]
        kids = [tree.tokens[c] for c in tree.children[i]]
        assert kids == plain.topk(len(kids)).indices.tolist()


def test_max_depth_truncates_the_tree(draft):
    drafter = ModelTreeDrafter(draft, (2, 2, 2))
    drafter.begin(RequestState.of([1, 2, 3]))
    proposal = drafter.propose(RequestState.of([1, 2, 3], SamplingParams(), None, True),
                               1, StaticLength(1))
    assert proposal.tree.depth == 1 and len(proposal.tree) == 3 and proposal.forward_calls == 1


def test_child_draws_follow_q():
    """With replacement: i.i.d. pairs; without: P(a, b) = q(a) q(b) / (1 - q(a))."""
    n, vocab = 100_000, 5
    q = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    probs = q.expand(n, vocab)
    iid = (q.unsqueeze(1) * q).flatten()
    wor = (q.unsqueeze(1) * q / (1 - q.unsqueeze(1))).fill_diagonal_(0).flatten()
    for replacement, law in [(True, iid), (False, wor)]:
        pairs = torch.tensor(draw_children(probs, 2, torch.Generator().manual_seed(2), replacement))
        cells = pairs[:, 0] * vocab + pairs[:, 1]
        assert tv(cells, law) < tv_bound(n, vocab * vocab)
    # support smaller than the branching: fewer children, never a zero-probability token
    sparse = torch.tensor([[0.0, 0.7, 0.0, 0.3, 0.0]])
    kids = draw_children(sparse, 4, torch.Generator().manual_seed(0), False)
    assert sorted(kids[0]) == [1, 3]


def test_method_strings_with_trees(target, tokenizer, draft):
    spec = parse_method("draft:tree=4x2x2x1,verify=mcss-wor")
    assert spec.tree == (4, 2, 2, 1) and spec["verify"] == "mcss-wor"
    engine = build_generator(spec, target, tokenizer, draft)
    assert engine.controller.max_tokens() == 4  # the depth
    assert parse_method("draft:k=3").tree is None
    assert parse_method("draft:tree=8x8,max_nodes=72").tree == (8, 8)
    assert parse_method("draft:verify=mcss").tree is None  # a tree verifier walks chains too
    for text, message in [
        ("draft:tree=4xx2", "'' is not a positive integer"),
        ("draft:tree=8x8", "72 nodes .* limit of 64"),
        ("draft:tree=2x2,verify=speculative", "a token tree needs verify=greedy, mcss"),
        ("draft:tree=2x2,ctrl=heuristic", "fixed shape"),
        ("draft:tree=2x2,verify=magic", "unknown verifier"),
    ]:
        with pytest.raises(InputError, match=message):
            parse_method(text)
