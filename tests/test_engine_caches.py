"""Both KV caches after every kind of decode step, on context-sensitive toy models.

A scripted draft forces each kind of step (all drafts accepted, rejected at the first
draft, a partial acceptance, a tree path that is not the cache's prefix); after each step
the target's cache must hold exactly the accepted context (all but its last token) with
the keys and values a fresh prefill of it gives, and the draft's cache exactly the context
tokens its drafter says it holds, with the keys and values of a fresh prefill of those.
The models (tests/toy_models.py) read their context, so a stale cache also changes the
output, which the engine's exactness checks then catch.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest
import torch

from adaspec.backends.base import ForwardOutput
from adaspec.backends.torch.backend import TorchBackend
from adaspec.draft.model import ModelDrafter
from adaspec.draft.model_tree import ModelTreeDrafter
from adaspec.engine.steps import GenerationResult, StreamChunk
from adaspec.methods.build import build_generator
from tests.toy_models import greedy_next, reference_greedy, toy_model

V = 64
PROMPT = [5, 17, 42, 8, 33, 1, 60]

# A plan scripts one step: ranks[d] is where the target's own next token goes among the
# draft's candidates at depth d (0: the first candidate; None: not among them, so the
# verifier rejects there). Depths past the list: None.
Ranks = Sequence[int | None]


@pytest.fixture(scope="module")
def target_model():
    return toy_model(seed=0)


@pytest.fixture(scope="module")
def draft_model():
    return toy_model(seed=1)


class RecordingTarget(TorchBackend):
    """The target backend, recording how each step rolled its cache back."""

    def __init__(self, model) -> None:
        super().__init__(model, name="toy-target")
        self.rollbacks: list[tuple[str, object]] = []

    def truncate(self, length: int) -> None:
        self.rollbacks.append(("truncate", length))
        super().truncate(length)

    def keep(self, indices: torch.Tensor) -> None:
        self.rollbacks.append(("keep", indices.tolist()))
        super().keep(indices)


class ScriptedDraft(TorchBackend):
    """The draft model with its choices scripted: every row of logits it returns is the
    model's own, except that the plan's candidates are lifted to the top in the plan's
    order (and the target's token pushed to the bottom when the plan rejects). Its cache
    and keys/values are the draft model's own: that is what the tests check. It tracks the
    tokens its cache holds, to know the sequence each returned row predicts from."""

    def __init__(self, model, target_model, width: int) -> None:
        super().__init__(model, name="toy-draft")
        self.target_model = target_model
        self.width = width  # candidates placed per row (the tree's widest level)
        self.tokens: list[int] = []  # cache order
        self.base = 0  # length of the accepted context at this step (root included)
        self.ranks: Ranks = ()

    def reset(self) -> None:
        super().reset()
        self.tokens = []

    def truncate(self, length: int) -> None:
        super().truncate(length)
        del self.tokens[length:]

    def keep(self, indices: torch.Tensor) -> None:
        super().keep(indices)
        self.tokens = [self.tokens[i] for i in indices.tolist()]

    def prefill(self, tokens, hidden_layer=None, reuse=0) -> ForwardOutput:
        out = super().prefill(tokens, hidden_layer, reuse)
        self.tokens = []
        return self._script(out, tokens, None)

    def forward(self, tokens, positions=None, tree_mask=None, hidden_layer=None):
        out = super().forward(tokens, positions, tree_mask, hidden_layer)
        return self._script(out, tokens, tree_mask)

    def _script(self, out: ForwardOutput, tokens: torch.Tensor, mask) -> ForwardOutput:
        before = list(self.tokens)
        new = [int(t) for t in tokens.view(-1)]
        self.tokens = before + new
        logits = out.logits.clone()
        rows = logits.shape[0]
        for r in range(rows):
            i = len(new) - rows + r  # the fed token this row follows
            if mask is None:
                seq = before + new[: i + 1]
            else:
                row = mask[i].tolist()
                every = before + new
                if len(row) == len(new):  # a mask over the new tokens only
                    seq = before + [t for t, m in zip(new, row, strict=True) if m]
                else:
                    seq = [t for t, m in zip(every, row, strict=True) if m]
            self._place(logits[r], seq)
        return ForwardOutput(logits=logits, hidden=out.hidden)

    def _place(self, row: torch.Tensor, seq: list[int]) -> None:
        depth = len(seq) - self.base  # 0: the row after the root proposes depth-1 nodes
        if depth < 0:
            return  # a prompt prefill: nothing is drafted from it
        rank = self.ranks[depth] if depth < len(self.ranks) else None
        right = greedy_next(self.target_model, seq)
        wrong = [(right + 1 + j) % V for j in range(self.width)]
        order = [right if r == rank else wrong.pop(0) for r in range(self.width)]
        low, top = float(row.min()), float(row.max())
        row[right] = low - 100.0
        for j, tok in enumerate(order):
            row[tok] = top + 100.0 - j


def assert_cache_is_prefill(backend: TorchBackend, model, tokens: list[int]) -> None:
    """The backend's cache holds `tokens` with the keys/values a fresh prefill gives."""
    assert backend.cache_len == len(tokens)
    fresh = TorchBackend(model)
    fresh.prefill(torch.tensor(tokens))
    for got, want in zip(backend._layers(), fresh._layers(), strict=True):
        assert got.keys.shape[-2] == len(tokens)
        torch.testing.assert_close(got.keys, want.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.values, want.values, rtol=1e-4, atol=1e-4)


def accepted_depth(ranks: Ranks, depth: int) -> int:
    n = 0
    while n < depth and n < len(ranks) and ranks[n] is not None:
        n += 1
    return n


def run_plans(engine, target, draft, target_model, draft_model, plans: list[Ranks],
              depth: int, check_draft: Callable[[list[int], int], None]) -> list[int]:
    """Decode PROMPT one step per plan; after each, check tokens and both caches."""
    want = reference_greedy(target_model, PROMPT, len(plans) * (depth + 1) + 1)
    stream = engine.stream(PROMPT, max_new_tokens=len(want), chat=False)
    first = next(stream)
    assert isinstance(first, StreamChunk) and first.token_ids == want[:1]
    generated = list(first.token_ids)
    for ranks in plans:
        draft.base, draft.ranks = len(PROMPT) + len(generated), ranks
        chunk = next(stream)
        assert isinstance(chunk, StreamChunk)
        accepted = accepted_depth(ranks, depth)
        assert len(chunk.token_ids) == accepted + 1, (ranks, chunk.token_ids)
        generated += chunk.token_ids
        assert generated == want[: len(generated)], ranks  # exact: the target's tokens
        context = PROMPT + generated
        # the target holds the accepted context but its last token (the next root)
        assert_cache_is_prefill(target, target_model, context[:-1])
        check_draft(context, accepted)
    return generated


CHAIN_PLANS: list[Ranks] = [
    [0, 0, 0, 0],  # all accepted
    [None],  # rejected at 0
    [0, 0, None],  # partial: 2 of 4
    [0, 0, 0, 0],  # all accepted again (after a rejection)
    [0, None],  # partial: 1
    [None],  # rejected at 0 again
    [0, 0, 0, None],  # partial: 3 (the last draft token rejected)
    [None],
    [0, 0, 0, 0],
]


def test_chain_steps_keep_both_caches_exact(target_model, draft_model):
    k = 4
    target = RecordingTarget(target_model)
    draft = ScriptedDraft(draft_model, target_model, width=1)
    engine = build_generator(f"draft:k={k}", target, None, draft, eos_token_ids=[])
    drafter = engine.drafter
    assert isinstance(drafter, ModelDrafter)

    def check_draft(context: list[int], accepted: int) -> None:
        # the draft fed the context and its drafts but the last one; after the step it
        # keeps what the new context still agrees with
        held = len(context) - (2 if accepted == k else 1)
        assert drafter.cached_len == held
        assert draft.tokens == context[:held]
        assert_cache_is_prefill(draft, draft_model, context[:held])

    run_plans(engine, target, draft, target_model, draft_model, CHAIN_PLANS, k, check_draft)
    # every step cut the target's cache: to the root plus the accepted drafts
    assert [kind for kind, _ in target.rollbacks] == ["truncate"] * len(CHAIN_PLANS)


TREE_PLANS: list[Ranks] = [
    [0, 0, 0],  # all accepted along first candidates: path [1, 3, 7], not the cache prefix
    [None],  # rejected at 0: a cut
    [1, 0, 0],  # all accepted through a second candidate: path [2, 5, 9]
    [0, None],  # partial, path [1]: the cache prefix, a cut
    [1, 1, None],  # partial through second candidates: path [2, 6]
    [None],
    [0, 1, 0],  # path [1, 4, 8]
    [1, None],  # path [2]: one node, not the first
]
TREE_PATHS = [[1, 3, 7], [], [2, 5, 9], [1], [2, 6], [], [1, 4, 8], [2]]


def test_tree_steps_keep_both_caches_exact(target_model, draft_model):
    branching = (2, 2, 1)
    target = RecordingTarget(target_model)
    draft = ScriptedDraft(draft_model, target_model, width=2)
    engine = build_generator("draft:tree=2x2x1", target, None, draft, eos_token_ids=[])
    drafter = engine.drafter
    assert isinstance(drafter, ModelTreeDrafter) and drafter.branching == branching

    def check_draft(context: list[int], accepted: int) -> None:
        # the draft fed every level but the leaves; it keeps the context and the accepted
        # nodes it fed
        held = len(context) - (2 if accepted == len(branching) else 1)
        assert drafter.cached_tokens == context[:held]
        assert draft.tokens == context[:held]
        assert_cache_is_prefill(draft, draft_model, context[:held])

    start = len(PROMPT)
    generated = run_plans(engine, target, draft, target_model, draft_model, TREE_PLANS,
                          len(branching), check_draft)
    assert len(generated) == 1 + sum(len(p) + 1 for p in TREE_PATHS)
    # how the target rolled back: a cut when the path is the cache's prefix, else a
    # compaction keeping the context and the path's nodes
    root = start  # cache index of the root at the first step
    for (kind, arg), path in zip(target.rollbacks, TREE_PATHS, strict=True):
        if path == list(range(1, len(path) + 1)):
            assert (kind, arg) == ("truncate", root + 1 + len(path))
        else:
            assert (kind, arg) == ("keep", [*range(root + 1), *(root + i for i in path)])
        root += len(path) + 1


@pytest.mark.parametrize("method", ["draft:k=3", "draft:k=6", "draft:tree=2x2x1",
                                    "draft:tree=3x2x2"])
def test_random_steps_keep_both_caches_exact(target_model, draft_model, method):
    """Seeded random plans (each depth right 70% of the time, at a random rank)."""
    tree = "tree" in method
    branching = tuple(int(b) for b in method.split("=")[1].split("x")) if tree else None
    depth = len(branching) if tree else int(method.split("=")[1])
    rng = random.Random(method)
    widths = branching or (1,) * depth
    plans = [[rng.randrange(widths[d]) if rng.random() < 0.7 else None for d in range(depth)]
             for _ in range(10)]
    target = TorchBackend(target_model)
    draft = ScriptedDraft(draft_model, target_model, width=max(branching) if tree else 1)
    engine = build_generator(method, target, None, draft, eos_token_ids=[])
    drafter = engine.drafter

    def check_draft(context: list[int], accepted: int) -> None:
        held = len(context) - (2 if accepted == depth else 1)
        cached = drafter.cached_tokens if tree else context[: drafter.cached_len]
        assert cached == context[:held]
        assert_cache_is_prefill(draft, draft_model, context[:held])

    run_plans(engine, target, draft, target_model, draft_model, plans, depth, check_draft)


def test_plain_decoding_cache_is_the_context(target_model):
    target = TorchBackend(target_model)
    engine = build_generator("ar", target, None, eos_token_ids=[])
    want = reference_greedy(target_model, PROMPT, 12)
    generated: list[int] = []
    for item in engine.stream(PROMPT, max_new_tokens=12, chat=False):
        if isinstance(item, GenerationResult):
            assert item.token_ids == want
            break
        generated += item.token_ids
        assert_cache_is_prefill(target, target_model, (PROMPT + generated)[:-1])


@pytest.mark.parametrize("method", ["draft:k=4", "draft:tree=2x2x1"])
def test_unrelated_draft_gives_the_targets_tokens(target_model, draft_model, method):
    """An unscripted draft of another seed (it almost never agrees): every step rejects,
    and a cache that missed one rollback would change the toy target's next token."""
    engine = build_generator(method, TorchBackend(target_model), None,
                          TorchBackend(draft_model), eos_token_ids=[])
    for prompt in (PROMPT, [3, 3, 3], [60, 2, 9, 14, 14, 0, 7, 7, 31]):
        res = engine.generate(prompt, max_new_tokens=30)
        assert res.token_ids == reference_greedy(target_model, prompt, 30)


def test_the_draft_is_scripted_as_planned(target_model, draft_model):
    """The script itself: at depth 0 the first candidate is the target's token when the
    rank is 0, a wrong one (and the target's token nowhere near the top) when None."""
    draft = ScriptedDraft(draft_model, target_model, width=2)
    draft.base = len(PROMPT)
    draft.ranks = [1]
    logits = draft.prefill(torch.tensor(PROMPT)).logits[-1]
    right = greedy_next(target_model, PROMPT)
    assert logits.topk(2).indices.tolist()[1] == right
    draft.ranks = [None]
    draft.reset()
    logits = draft.prefill(torch.tensor(PROMPT)).logits[-1]
    assert int(logits.argmin()) == right
