"""Tree verifiers: statistical exactness of MCSS (with / without replacement) and MCNS, path
level at depth 1, 2 and 3; wrong verifiers fail the same bound; greedy and edge cases.

The toy language is the per-prefix tables of tests/test_verify.py (target p and draft q
depend on the whole prefix). For N sequences at once a regular tree is drafted below each
prefix by an independent sampler written here, the library's batched `walk_regular` verifies
it, and the loop repeats until every sequence has T tokens; the empirical law of the first T
tokens is compared with the exact product of target tables over its V**T cells with the
bound of tests/test_verify.py (1e-6 false alarm). `walk_regular` and `verify_tree` (the
per-step API the engine calls) agree draw for draw, so the statistics cover both.
"""

from __future__ import annotations

import pytest
import torch

from adaspec.engine.token_tree import TokenTree
from adaspec.errors import InputError
from adaspec.verify.multi_candidate import (
    GreedyTreeVerifier,
    MCNSVerifier,
    MCSSVerifier,
    MCSSWithoutReplacementVerifier,
    TreeVerifier,
    get_tree_verifier,
    greedy_step,
    mcss_step,
)

from .test_verify import Tables, categorical, tv, tv_bound

N = 100_000


def draw(
    q: torch.Tensor, count: int, gen: torch.Generator, replacement: bool, top: bool = False
) -> torch.Tensor:
    """count candidates per row of q [B, V]: i.i.d., without replacement, or the top ones."""
    if top:
        return q.topk(count, dim=1).indices
    if replacement:
        return torch.stack([categorical(q, gen) for _ in range(count)], 1)
    rest = q.clone()
    picks = []
    for _ in range(count):
        tok = categorical(rest / rest.sum(1, keepdim=True), gen)
        picks.append(tok)
        rest.scatter_(1, tok.unsqueeze(1), 0.0)
    return torch.stack(picks, 1)


def draft_tree(
    prefix: torch.Tensor,
    target: Tables,
    draft: Tables,
    branching: tuple[int, ...],
    gen: torch.Generator,
    replacement: bool,
    top: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B trees in level order below B prefixes of one length: tokens [B, n], q [B, m, V] (the
    rows the children were drawn from), p [B, n, V] (target row after each node's path)."""
    batch, length = prefix.shape
    vocab = target.vocab
    index = (prefix * vocab ** torch.arange(length - 1, -1, -1)).sum(1)
    nodes = [(index, 0, torch.zeros(batch, dtype=torch.long))]  # (path index, depth, token)
    q_rows = []
    frontier = [0]
    for count in branching:
        nxt = []
        for node in frontier:
            idx, depth, _ = nodes[node]
            q = draft.rows(length + depth, idx)
            q_rows.append(q)
            kids = draw(q, count, gen, replacement, top)
            for c in range(count):
                nodes.append((idx * vocab + kids[:, c], depth + 1, kids[:, c]))
                nxt.append(len(nodes) - 1)
        frontier = nxt
    tokens = torch.stack([tok for _, _, tok in nodes], 1)
    p = torch.stack([target.rows(length + d, idx) for idx, d, _ in nodes], 1)
    return tokens, torch.stack(q_rows, 1), p


def emit(
    verifier: TreeVerifier,
    target: Tables,
    draft: Tables,
    branching: tuple[int, ...],
    length: int,
    seed: int,
    replacement: bool | None = None,
    deterministic: bool = False,
    n: int = N,
) -> torch.Tensor:
    """Decode until each of n sequences has `length` tokens; their first `length` as one
    base-V cell id each."""
    gen = torch.Generator().manual_seed(seed)
    replacement = verifier.replacement if replacement is None else replacement
    out = torch.full((n, length), -1, dtype=torch.long)
    have = torch.zeros(n, dtype=torch.long)
    while bool((have < length).any()):
        for done in range(length):
            rows = torch.nonzero(have == done).squeeze(1)
            if not len(rows):
                continue
            tokens, q, p = draft_tree(
                out[rows, :done], target, draft, branching, gen, replacement, deterministic
            )
            path, accepted, nxt = verifier.walk_regular(
                branching, tokens, None if deterministic else q, p, gen
            )
            step = torch.cat([tokens.gather(1, path.clamp(min=0)), nxt.unsqueeze(1)], 1)
            step[torch.arange(len(rows)), accepted] = nxt
            for j in range(min(len(branching) + 1, length - done)):
                write = j <= accepted
                out[rows[write], done + j] = step[write, j]
            have[rows] = (done + accepted + 1).clamp(max=length)
    vocab = target.vocab
    return (out * vocab ** torch.arange(length - 1, -1, -1)).sum(1)


def exact_law(target: Tables, length: int) -> torch.Tensor:
    law = target.tables[0][0]
    for ell in range(1, length):
        law = (law.unsqueeze(1) * target.tables[ell]).flatten()
    return law


# ---------------------------------------------------------------------------------------------
# Deliberately wrong verifiers.


class NoResidual(TreeVerifier):
    """Tests every candidate against the original p instead of the running residual."""

    name = "wrong-no-residual"
    replacement = True

    def step(self, candidates, q, p, generator):
        batch, k = candidates.shape
        u = torch.rand(batch, k, generator=generator, dtype=p.dtype)
        choice = torch.full((batch,), -1, dtype=torch.long)
        for i in range(k):
            x = candidates[:, i : i + 1]
            ok = (choice < 0) & (u[:, i] * q.gather(1, x).squeeze(1) < p.gather(1, x).squeeze(1))
            choice = torch.where(ok, i, choice)
        residual = (p - q).clamp(min=0) if k else p
        residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, p)
        token = categorical(residual / residual.sum(1, keepdim=True), generator)
        picked = candidates.gather(1, choice.clamp(min=0).unsqueeze(1)).squeeze(1) if k else token
        return choice, torch.where(choice >= 0, picked, token)


class IgnoresRenormalisation(MCSSVerifier):
    """Algorithm 1 applied to candidates drawn without replacement (q not renormalised)."""

    name = "wrong-alg1-on-wor"
    replacement = False


WRONG = [NoResidual(), IgnoresRenormalisation()]
RIGHT = [MCSSVerifier(), MCSSWithoutReplacementVerifier(), MCNSVerifier()]

CASES = [  # (vocab, branching, tokens checked, draft sharpness, target sharpness, zeros in p)
    pytest.param(6, (3,), 1, 1.0, 1.5, 0, id="depth1-V6-b3"),
    pytest.param(6, (2, 2), 2, 1.0, 1.5, 0, id="depth2-V6-2x2"),
    pytest.param(5, (3, 2, 1), 3, 1.0, 1.5, 0, id="depth3-V5-3x2x1"),
    pytest.param(5, (3, 2, 1), 3, 2.5, 1.5, 0, id="depth3-V5-3x2x1-sharp-draft"),
    pytest.param(5, (2, 1, 1), 3, 1.5, 1.0, 2, id="depth3-V5-2x1x1-p-zeros"),
]


@pytest.mark.parametrize("verifier", RIGHT, ids=lambda v: v.name)
@pytest.mark.parametrize(("vocab", "branching", "length", "q_sharp", "p_sharp", "zeros"), CASES)
def test_tree_verifiers_are_exact_at_path_level(
    verifier, vocab, branching, length, q_sharp, p_sharp, zeros
):
    depth = length - 1 + len(branching)
    target = Tables(vocab, depth, seed=30 + vocab + depth, sharp=p_sharp, zeros=zeros)
    draft = Tables(vocab, depth, seed=40 + vocab + depth, sharp=q_sharp)
    cells = emit(verifier, target, draft, branching, length, seed=7)
    law = exact_law(target, length)
    distance, bound = tv(cells, law), tv_bound(N, vocab**length)
    assert distance < bound, f"{verifier.name}: TV {distance:.4f} >= {bound:.4f}"
    if zeros:  # a sequence the target forbids is never emitted
        assert float(law[cells].min()) > 0


@pytest.mark.parametrize("wrong", WRONG, ids=lambda v: v.name)
def test_wrong_tree_verifiers_fail_the_same_check(wrong):
    """The sharp-draft depth-3 case above; measured TV 0.30 and 0.22 against a bound of
    0.026 (the right verifiers: 0.012)."""
    vocab, branching, length = 5, (3, 2, 1), 3
    target = Tables(vocab, 5, seed=40, sharp=1.5)
    draft = Tables(vocab, 5, seed=50, sharp=2.5)
    cells = emit(wrong, target, draft, branching, length, seed=7)
    distance, bound = tv(cells, exact_law(target, length)), tv_bound(N, vocab**length)
    assert distance > 3 * bound, f"{wrong.name}: TV {distance:.4f} is not far above {bound:.4f}"


@pytest.mark.parametrize("verifier", [MCSSVerifier(), MCSSWithoutReplacementVerifier()])
def test_deterministic_candidates_are_exact(verifier):
    """q None (the top-k at temperature 0, or any deterministic list): each candidate counts
    as probability 1 and MCSS stays exact."""
    vocab, branching, length = 6, (3, 2), 2
    target = Tables(vocab, 3, seed=5, sharp=1.5)
    draft = Tables(vocab, 3, seed=6, sharp=1.0)
    cells = emit(verifier, target, draft, branching, length, seed=3, deterministic=True)
    assert tv(cells, exact_law(target, length)) < tv_bound(N, vocab**length)


def test_more_candidates_accept_more():
    """Sanity of the point of it all: per step, MCSS-WOR with 3 candidates accepts more than
    one candidate (speculative sampling), and more than MCNS with the same candidates."""
    vocab = 8
    target = Tables(vocab, 1, seed=8, sharp=1.0)
    draft = Tables(vocab, 1, seed=9, sharp=1.0)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.zeros(20_000, 0, dtype=torch.long)
    rates = {}
    for name, verifier, b in [
        ("chain", MCSSVerifier(), 1),
        ("wor", MCSSWithoutReplacementVerifier(), 3),
        ("mcns", MCNSVerifier(), 3),
    ]:
        tokens, q, p = draft_tree(prefix, target, draft, (b,), gen, verifier.replacement)
        _, accepted, _ = verifier.walk_regular((b,), tokens, q, p, gen)
        rates[name] = float(accepted.float().mean())
    assert rates["wor"] > rates["chain"] + 0.1
    assert rates["wor"] > rates["mcns"]


@pytest.mark.parametrize("verifier", RIGHT + [GreedyTreeVerifier()], ids=lambda v: v.name)
def test_verify_tree_makes_the_same_draws_as_the_batched_walk(verifier):
    g = torch.Generator().manual_seed(12)
    branching = (3, 2, 1)
    vocab = 7
    target = Tables(vocab, 3, seed=1, sharp=2.0)
    draft = Tables(vocab, 3, seed=2, sharp=2.0)
    tokens, q, p = draft_tree(
        torch.zeros(200, 0, dtype=torch.long), target, draft, branching, g, verifier.replacement
    )
    parents = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3, *range(4, 10)]
    for i in range(200):
        tree = TokenTree(tokens[i].tolist(), parents)
        seed = int(torch.randint(2**31, (1,), generator=g))
        verdict = verifier.verify_tree(tree, q[i], p[i], torch.Generator().manual_seed(seed))
        path, accepted, nxt = verifier.walk_regular(
            branching,
            tokens[i : i + 1],
            q[i : i + 1],
            p[i : i + 1],
            torch.Generator().manual_seed(seed),
        )
        assert verdict.path == path[0, : int(accepted[0])].tolist()
        assert verdict.next_token == int(nxt[0])


def test_exhausted_support_gives_fewer_children_and_stays_exact():
    """Without replacement a node gets at most as many children as q has tokens; the walk
    over such an irregular tree (verify_tree) still emits p."""
    vocab, n = 6, 5_000
    g = torch.Generator().manual_seed(4)
    p = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
    q = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.5, 0.0])  # two tokens only, branching 3
    child = torch.full((vocab,), 1.0 / vocab)
    verifier = MCSSWithoutReplacementVerifier()
    firsts = []
    for _ in range(n):
        kids = draw(q.unsqueeze(0), 2, g, replacement=False)[0].tolist()
        tree = TokenTree([0, *kids], [-1, 0, 0])
        verdict = verifier.verify_tree(tree, q.unsqueeze(0), torch.stack([p, child, child]), g)
        firsts.append(tree.tokens[verdict.path[0]] if verdict.path else verdict.next_token)
    assert tv(torch.tensor(firsts), p) < tv_bound(n, vocab)


# ---------------------------------------------------------------------------------------------
# Unit cases


def test_candidate_the_target_forbids_is_never_followed():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    q = torch.tensor([[0.0, 0.0, 0.5, 0.5]])
    gen = torch.Generator().manual_seed(0)
    for replacement in (True, False):
        for _ in range(100):
            choice, token = mcss_step(torch.tensor([[2, 3]]), q, p, gen, replacement)
            assert int(choice[0]) == -1 and int(token[0]) in (0, 1)


def test_equal_distributions_accept_the_first_candidate():
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        choice, token = mcss_step(torch.tensor([[3, 1]]), p, p, gen)
        assert (int(choice[0]), int(token[0])) == (0, 3)


def test_duplicate_candidates_with_replacement():
    """x drawn twice: after x is rejected once the residual is 0 at x, so x is rejected again
    and the second candidate is only a second chance for nothing; still exact."""
    p = torch.tensor([[0.2, 0.8]])
    q = torch.tensor([[0.9, 0.1]])
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(4000):
        choice, token = mcss_step(torch.tensor([[0, 0]]), q, p, gen)
        assert int(choice[0]) in (-1, 0)
        out.append(int(token[0]))
    assert abs(sum(t == 0 for t in out) / 4000 - 0.2 / 0.9) < 0.03  # P(accept x=0) = p/q


def test_greedy_follows_argmax_or_emits_it():
    logits = torch.tensor([[0.1, 2.0, 0.3], [3.0, 0.0, 0.0]])
    choice, token = greedy_step(torch.tensor([[0, 1], [1, 2]]), None, logits, None)
    assert choice.tolist() == [1, -1] and token.tolist() == [1, 0]
    tree = TokenTree([9, 2, 1, 0], [-1, 0, 0, 2])
    rows = torch.nn.functional.one_hot(torch.tensor([1, 0, 1, 2]), 3).float()
    verdict = GreedyTreeVerifier().verify_tree(tree, None, rows, None)
    assert verdict.path == [2] and verdict.next_token == 1  # node 2 (token 1), then argmax 1
    rows[2] = torch.tensor([1.0, 0.0, 0.0])  # argmax after node 2 is node 3's token
    verdict = GreedyTreeVerifier().verify_tree(tree, None, rows, None)
    assert verdict.path == [2, 3] and verdict.next_token == 2  # bonus at the leaf


def test_bad_inputs_name_the_problem():
    tree = TokenTree([0, 1, 2], [-1, 0, 0])
    p = torch.full((3, 4), 0.25)
    with pytest.raises(InputError, match="target_probs"):
        MCSSVerifier().verify_tree(tree, None, p[:2], None)
    with pytest.raises(InputError, match="candidate token ids"):
        mcss_step(torch.tensor([[7]]), None, p[:1], None)
    with pytest.raises(InputError, match="unknown tree verifier 'magic'"):
        get_tree_verifier("magic")
    assert isinstance(get_tree_verifier("mcss-wor"), MCSSWithoutReplacementVerifier)
