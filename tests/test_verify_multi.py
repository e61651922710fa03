"""Tree verifiers: statistical exactness of MCSS (with / without replacement) and MCNS at
path level (depth 1, 2 and 3), negative controls for each classic bug that the same check
must reject, the replacement check, greedy and edge cases.

The toy language is the per-prefix tables of tests/test_verify.py (target p and draft q
depend on the whole prefix). For n sequences at once a regular tree is drafted below each
prefix by an independent sampler written here, the library's batched `walk_regular` verifies
it, and the loop repeats until every sequence has T tokens; the empirical law of the first T
tokens is compared with the exact product of target tables over its V**T cells by the
chi-square of tests/stats_helpers.py (a right verifier: p > 1e-6; a broken one: p < 1e-12).
`walk_regular` and `verify` (the per-step API the engine calls) make the same draws (tested
below), so the statistics cover both.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from adaspec.core.proposal import Proposal
from adaspec.core.token_tree import TokenTree
from adaspec.errors import InputError
from adaspec.verify import VERIFIERS, GreedyVerifier, SpeculativeVerifier, Verdict
from adaspec.verify.multi_candidate import (
    MCNSVerifier,
    MCSSVerifier,
    MCSSWithoutReplacementVerifier,
    TreeWalkVerifier,
    mcns_step,
    mcss_step,
)

from .stats_helpers import ALPHA, POWER, Fit, assert_caught, assert_exact, fit
from .test_verify import Tables, categorical

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
        tok = categorical(rest, gen)
        picks.append(tok)
        rest.scatter_(1, tok.unsqueeze(1), 0.0)
    return torch.stack(picks, 1)


def regular_parents(branching: tuple[int, ...]) -> list[int]:
    parents, frontier = [-1], [0]
    for b in branching:
        nxt = []
        for node in frontier:
            for _ in range(b):
                parents.append(node)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return parents


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
    nodes = [(index, 0, prefix[:, -1] if length else torch.zeros(batch, dtype=torch.long))]
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
    verifier: TreeWalkVerifier,
    target: Tables,
    draft: Tables,
    branching: tuple[int, ...],
    length: int,
    seed: int,
    replacement: bool,
    deterministic: bool = False,
    n: int = N,
) -> torch.Tensor:
    """Decode until each of n sequences has `length` tokens; their first `length` as one
    base-V cell id each. `replacement`: how this drafter draws siblings; each step's proposal
    says so and the verifier checks it (an MCSS rule refuses the other kind)."""
    gen = torch.Generator().manual_seed(seed)
    parents = regular_parents(branching)
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
            q = None if deterministic else q
            first = Proposal(
                TokenTree(tokens[0].tolist(), parents),
                None if q is None else q[0],
                replacement=None if q is None else replacement,
            )
            verifier.check(first, p[0])
            if verifier.needs_matching_draws and q is not None:
                assert first.replacement == verifier.replacement
            path, accepted, nxt = verifier.walk_regular(branching, tokens, q, p, gen)
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
# Deliberately broken rules (never in src/): the statistical check must reject each one.

Step = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Generator | None],
    tuple[torch.Tensor, torch.Tensor],
]


def broken_mcss(bug: str, replacement: bool) -> Step:
    """MCSS (Algorithms 1 and 2) with one classic mistake:
    accept_all: follow the first candidate at every node (the output follows the draft);
    correction_from_p: residuals updated between siblings, but when every candidate is
        rejected the token is drawn from p instead of the residual;
    no_residual: every sibling is tested against p (r stays p after a rejection), and
        the token after the last rejection drawn from norm(max(0, p - q)), the chain rule
        applied to each candidate on its own."""

    def step(candidates, q, p, generator):
        batch, k = candidates.shape
        if bug == "accept_all" and k:
            return torch.zeros(batch, dtype=torch.long), candidates[:, 0]
        u = torch.rand(batch, k, generator=generator, dtype=p.dtype)
        choice = torch.full((batch,), -1, dtype=torch.long)
        r = last = p
        q_i = q
        for i in range(k):
            active = choice < 0
            x = candidates[:, i : i + 1]
            r_x = r.gather(1, x).squeeze(1)
            q_x = torch.ones_like(r_x) if q_i is None else q_i.gather(1, x).squeeze(1)
            accept = active & (u[:, i] * q_x < r_x)
            choice = torch.where(accept, i, choice)
            rejected = (active & ~accept).unsqueeze(1)
            residual = r.scatter(1, x, 0.0) if q_i is None else (r - q_i).clamp(min=0.0)
            mass = residual.sum(1, keepdim=True)
            residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), r)
            if bug == "no_residual":
                last = torch.where(rejected, residual, last)
            else:
                r = torch.where(rejected, residual, r)
            if q_i is not None and not replacement:
                q_i = q_i.scatter(1, x, 0.0)
                q_i = q_i / q_i.sum(1, keepdim=True).clamp(min=1e-30)
        final = {"correction_from_p": p, "no_residual": last}.get(bug, r)
        token = categorical(final, generator)
        if k:
            picked = candidates.gather(1, choice.clamp(min=0).unsqueeze(1)).squeeze(1)
            token = torch.where(choice >= 0, picked, token)
        return choice, token

    return step


def alg1_on_wor(candidates, q, p, generator):
    """Algorithm 1 (q not renormalised after each candidate) on candidates drawn without
    replacement: the library's own with-replacement rule, given the wrong kind of draws."""
    return mcss_step(candidates, q, p, generator, replacement=True)


def mcns_accept_all(candidates, q, p, generator):
    if candidates.shape[1]:
        return torch.zeros(len(candidates), dtype=torch.long), candidates[:, 0]
    return mcns_step(candidates, q, p, generator)


class Broken(TreeWalkVerifier):
    """A tree verifier running a broken step, posing as the rule it gets wrong (same
    `replacement`, so the drafter and the check treat it as that rule)."""

    def __init__(self, like: TreeWalkVerifier, bug: str, step: Step) -> None:
        self.name = f"{like.name}-{bug}"
        self.replacement = like.replacement
        self.needs_matching_draws = like.needs_matching_draws
        self._step = step

    def step(self, candidates, q, p, generator):
        return self._step(candidates, q, p, generator)


def variant(rule: str, bug: str) -> TreeWalkVerifier:
    right = {"mcss": MCSSVerifier, "mcss-wor": MCSSWithoutReplacementVerifier}
    like = right[rule]() if rule in right else MCNSVerifier()
    if bug == "right":
        return like
    if rule.startswith("mcns"):
        return Broken(like, bug, mcns_accept_all)
    if bug == "alg1_on_wor":
        return Broken(like, bug, alg1_on_wor)
    return Broken(like, bug, broken_mcss(bug, like.replacement))


# (rule, how the drafter draws siblings, the bugs): MCNS is exact with either kind of draw.
RULES = [
    ("mcss", True, ["accept_all", "correction_from_p", "no_residual"]),
    ("mcss-wor", False, ["accept_all", "correction_from_p", "no_residual", "alg1_on_wor"]),
    ("mcns", False, ["accept_all"]),
    ("mcns-iid", True, ["accept_all"]),
]
RULE_VARIANTS = [
    pytest.param(rule, drawn, bug, id=f"{rule}-{bug}")
    for rule, drawn, bugs in RULES
    for bug in ["right", *bugs]
]

CASES = [  # (vocab, branching, tokens checked, q sharpness, p sharpness, zeros p, zeros q, close)
    pytest.param(6, (3,), 1, 1.0, 1.5, 0, 0, 0, id="depth1-V6-b3"),
    pytest.param(6, (2, 2), 2, 1.0, 1.5, 0, 0, 0, id="depth2-V6-2x2"),
    pytest.param(5, (3, 2, 1), 3, 1.0, 1.5, 0, 0, 0, id="depth3-V5-3x2x1"),
    pytest.param(5, (3, 2, 1), 3, 2.5, 1.5, 0, 0, 0, id="depth3-V5-3x2x1-sharp-draft"),
    # q = 0 where p > 0 (reachable only by a correction) and p = 0 where q > 0
    pytest.param(6, (3, 2), 2, 1.5, 1.0, 2, 2, 0, id="depth2-V6-3x2-zeros-in-p-and-q"),
    # q = 0.75 p + 0.25 r: each MCSS bug but accept_all moves the law of the first two
    # tokens by TV 0.011-0.048 only (3 * 10^5 sequences here; rejected at p < 1e-23)
    pytest.param(6, (3, 2), 2, 1.0, 1.5, 1, 2, 0.25, id="depth2-V6-3x2-draft-close-to-target"),
]


def check_laws(cells: torch.Tensor, target: Tables, length: int) -> list[Fit]:
    """The first token against p(a), and the first `length` tokens against their exact law."""
    fits = [fit(cells // target.vocab ** (length - 1), target.tables[0][0])]
    if length > 1:
        fits.append(fit(cells, exact_law(target, length)))
    return fits


def make_case(vocab, depth, q_sharp, p_sharp, p_zeros, q_zeros, close):
    target = Tables(vocab, depth, seed=30 + vocab + depth, sharp=p_sharp, zeros=p_zeros)
    blend = (target, close) if close else None
    draft = Tables(vocab, depth, seed=40 + vocab + depth, sharp=q_sharp, zeros=q_zeros, blend=blend)
    return target, draft


@pytest.mark.parametrize(("rule", "drawn", "bug"), RULE_VARIANTS)
@pytest.mark.parametrize(
    ("vocab", "branching", "length", "q_sharp", "p_sharp", "p_zeros", "q_zeros", "close"), CASES
)
def test_tree_rules_are_exact_and_broken_ones_are_caught(
    rule, drawn, bug, vocab, branching, length, q_sharp, p_sharp, p_zeros, q_zeros, close
):
    depth = length - 1 + len(branching)
    target, draft = make_case(vocab, depth, q_sharp, p_sharp, p_zeros, q_zeros, close)
    p0, q0 = target.tables[0][0], draft.tables[0][0]
    if p_zeros:
        assert bool(((p0 == 0) & (q0 > 0)).any())
    if q_zeros and not close:
        assert bool(((q0 == 0) & (p0 > 0)).any())
    verifier = variant(rule, bug)
    n = 3 * N if close else N
    cells = emit(verifier, target, draft, branching, length, seed=7, replacement=drawn, n=n)
    fits = check_laws(cells, target, length)
    if bug == "right":
        assert_exact(fits, verifier.name)
    else:
        assert_caught(fits, verifier.name)


@pytest.mark.parametrize(("rule", "drawn"), [("mcss", True), ("mcss-wor", False)])
def test_the_gpu_control_flow_is_exact(monkeypatch, rule, drawn):
    """On a GPU the walk reads nothing back but its one verdict per level: every `may_hold`
    answers True, so each candidate's test and the final draw run whether or not a node
    had already chosen. The law of the emitted tokens is the target's on that path too."""
    import adaspec.verify.multi_candidate as multi_candidate

    monkeypatch.setattr(multi_candidate, "may_hold", lambda flags: True)
    target, draft = make_case(6, 3, 1.5, 1.0, 2, 2, 0)
    verifier = variant(rule, "right")
    cells = emit(verifier, target, draft, (3, 2), 2, seed=9, replacement=drawn)
    assert_exact(check_laws(cells, target, 2), f"{verifier.name}, device control flow")


@pytest.mark.parametrize(
    ("rule", "bug"),
    [("mcss", "right"), ("mcss-wor", "right"), ("mcss", "accept_all"),
     ("mcss", "correction_from_p"), ("mcss-wor", "no_residual")],
)
def test_deterministic_candidates(rule, bug):
    """q None (the top-k at temperature 0, or any deterministic list): each candidate counts
    as probability 1 and MCSS stays exact; the broken rules do not."""
    vocab, branching, length = 6, (3, 2), 2
    target = Tables(vocab, 3, seed=5, sharp=1.5)
    draft = Tables(vocab, 3, seed=6, sharp=1.0)
    verifier = variant(rule, bug)
    cells = emit(verifier, target, draft, branching, length, seed=3,
                 replacement=verifier.replacement, deterministic=True)
    fits = check_laws(cells, target, length)
    if bug == "right":
        assert_exact(fits, verifier.name)
    else:
        assert_caught(fits, verifier.name)


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


@pytest.mark.parametrize(
    "verifier", [MCSSVerifier(), MCSSWithoutReplacementVerifier(), MCNSVerifier()],
    ids=lambda v: v.name,
)
@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled", "top-k"])
def test_verify_makes_the_same_draws_as_the_batched_walk(verifier, deterministic):
    g = torch.Generator().manual_seed(12)
    branching = (3, 2, 1)
    vocab = 7
    target = Tables(vocab, 3, seed=1, sharp=2.0)
    draft = Tables(vocab, 3, seed=2, sharp=2.0)
    tokens, q, p = draft_tree(
        torch.zeros(200, 0, dtype=torch.long), target, draft, branching, g,
        verifier.replacement, top=deterministic,
    )
    parents = regular_parents(branching)
    assert parents == [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3, *range(4, 10)]
    for i in range(200):
        proposal = Proposal(
            TokenTree(tokens[i].tolist(), parents),
            None if deterministic else q[i],
            replacement=None if deterministic else verifier.replacement,
        )
        seed = int(torch.randint(2**31, (1,), generator=g))
        verdict = verifier.verify(proposal, p[i], torch.Generator().manual_seed(seed))
        path, accepted, nxt = verifier.walk_regular(
            branching,
            tokens[i : i + 1],
            None if deterministic else q[i : i + 1],
            p[i : i + 1],
            torch.Generator().manual_seed(seed),
        )
        assert verdict.path == path[0, : int(accepted[0])].tolist()
        assert verdict.next_token == int(nxt[0])


def test_exhausted_support_gives_fewer_children_and_stays_exact():
    """Without replacement a node gets at most as many children as q has tokens; the walk
    over such an irregular tree (`verify`) still emits p."""
    vocab, n = 6, 5_000
    g = torch.Generator().manual_seed(4)
    p = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
    q = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.5, 0.0])  # two tokens only, branching 3
    child = torch.full((vocab,), 1.0 / vocab)
    verifier = MCSSWithoutReplacementVerifier()
    firsts = []
    for _ in range(n):
        kids = draw(q.unsqueeze(0), 2, g, replacement=False)[0].tolist()
        proposal = Proposal(TokenTree([0, *kids], [-1, 0, 0]), q.unsqueeze(0), replacement=False)
        verdict = verifier.verify(proposal, torch.stack([p, child, child]), g)
        firsts.append(proposal.tree.tokens[verdict.path[0]] if verdict.path else verdict.next_token)
    assert_exact([fit(torch.tensor(firsts), p)], "exhausted support")


# ---------------------------------------------------------------------------------------------
# How the candidates were drawn: the proposal says, the verifier checks.


def test_check_refuses_the_wrong_kind_of_draws():
    tree = TokenTree([0, 1, 2, 3], [-1, 0, 0, 1])
    q = torch.full((2, 4), 0.25)
    p = torch.full((4, 4), 0.25)
    gen = torch.Generator().manual_seed(0)
    for verifier in [MCSSVerifier(), MCSSWithoutReplacementVerifier()]:
        assert verifier.needs_matching_draws
        other = not verifier.replacement
        wrong = Proposal(tree, q, replacement=other)
        with pytest.raises(InputError, match="needs sibling candidates drawn"):
            verifier.check(wrong, p)
        with pytest.raises(InputError, match="needs sibling candidates drawn"):
            verifier.verify(wrong, p, gen)
        # matching draws, deterministic candidates (q None), or no siblings drawn: fine
        verifier.verify(Proposal(tree, q, replacement=verifier.replacement), p, gen)
        verifier.verify(Proposal(tree, None, replacement=other), p, gen)
        verifier.verify(Proposal(tree, q, replacement=None), p, gen)
        verifier.verify(Proposal.chain(0, [1, 2], q), p[:3], gen)
    for verifier in [MCNSVerifier(), GreedyVerifier()]:  # exact with either kind
        assert not verifier.needs_matching_draws
        for replacement in (True, False, None):
            verifier.verify(Proposal(tree, q, replacement=replacement), p, gen)


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


@pytest.mark.parametrize("rule", ["mcns", "mcss", "mcss-wor"])
def test_a_draft_only_token_is_a_rejected_candidate(rule):
    """A draft with a larger vocabulary than the target's (q over 6 ids, p over 4) may propose
    ids 4 and 5, which the target cannot emit: every rule rejects them and still emits a
    token of p's (or follows a candidate p allows)."""
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    q = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.5, 0.5]])
    step = VERIFIERS[rule]().step
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        choice, token = step(torch.tensor([[4, 5]]), q, p, gen)
        assert int(choice[0]) == -1 and int(token[0]) in (0, 1)
    q = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.5, 0.0]])
    followed = set()
    for _ in range(100):
        choice, token = step(torch.tensor([[4, 1]]), q, p, gen)
        assert int(token[0]) in (0, 1) and int(choice[0]) in (-1, 1)
        assert (int(choice[0]) == 1) == (int(token[0]) == 1)
        followed.add(int(choice[0]))
    if rule == "mcns":  # y ~ p is 1 half the time, and then follows candidate 1
        assert followed == {-1, 1}


def test_equal_distributions_accept_the_first_candidate():
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        choice, token = mcss_step(torch.tensor([[3, 1]]), p, p, gen)
        assert (int(choice[0]), int(token[0])) == (0, 3)


def test_duplicate_candidates_with_replacement():
    """x drawn twice, p = (0.2, 0.8), q = (0.9, 0.1): x is accepted with p/q = 2/9; after a
    rejection the residual is 0 at x, so the second x is rejected too and the token is 1.
    So given these candidates token 0 comes out with probability 0.222, not p(0) = 0.2; 10^5
    draws tell the two apart (p < 1e-12), and the no-residual bug (0.395) too."""
    n = 100_000
    p = torch.tensor([[0.2, 0.8]]).expand(n, 2)
    q = torch.tensor([[0.9, 0.1]]).expand(n, 2)
    cands = torch.zeros(n, 2, dtype=torch.long)
    right = torch.tensor([2 / 9, 7 / 9], dtype=torch.float64)
    choice, token = mcss_step(cands, q, p, torch.Generator().manual_seed(1))
    assert set(choice.tolist()) == {-1, 0}
    assert fit(token, right).pvalue > ALPHA
    assert fit(token, torch.tensor([0.2, 0.8])).pvalue < POWER
    _, token = broken_mcss("no_residual", True)(cands, q, p, torch.Generator().manual_seed(1))
    assert fit(token, right).pvalue < POWER
    assert fit(token, torch.tensor([1 - (7 / 9) ** 2, (7 / 9) ** 2])).pvalue > ALPHA


def test_greedy_follows_argmax_or_emits_it():
    tree = TokenTree([9, 2, 1, 0], [-1, 0, 0, 2])
    rows = F.one_hot(torch.tensor([1, 0, 1, 2]), 3).float()
    verdict = GreedyVerifier().verify(Proposal(tree), rows, None)
    assert verdict.path == [2] and verdict.next_token == 1  # node 2 (token 1), then argmax 1
    rows[2] = torch.tensor([1.0, 0.0, 0.0])  # argmax after node 2 is node 3's token
    verdict = GreedyVerifier().verify(Proposal(tree), rows, None)
    assert verdict.path == [2, 3] and verdict.next_token == 2  # bonus at the leaf
    logits = torch.tensor([[3.0, 0.2, 0.1], [0.0] * 3, [0.0] * 3, [0.0] * 3])  # raw logits
    assert GreedyVerifier().verify(Proposal(tree), logits, None) == Verdict([], 0)


def test_bad_inputs_name_the_problem():
    tree = TokenTree([0, 1, 2], [-1, 0, 0])
    p = torch.full((3, 4), 0.25)
    with pytest.raises(InputError, match="target_probs"):
        MCSSVerifier().verify(Proposal(tree), p[:2], None)
    with pytest.raises(InputError, match="candidate token ids"):
        mcss_step(torch.tensor([[7]]), None, p[:1], None)
    with pytest.raises(InputError, match="checks chains, not token trees"):
        SpeculativeVerifier().verify(Proposal(tree), p, None)
    with pytest.raises(InputError, match="unknown verifier 'magic'"):
        VERIFIERS["magic"]
    assert isinstance(VERIFIERS["mcss-wor"](), MCSSWithoutReplacementVerifier)
    with pytest.raises(InputError, match="do not fit"):
        MCSSVerifier().walk_regular((2,), torch.zeros(1, 4, dtype=torch.long), None,
                                    torch.full((1, 4, 4), 0.25), None)
