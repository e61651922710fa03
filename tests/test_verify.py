"""Verifiers on chains: statistical exactness of speculative sampling, negative controls that
the same check must reject, greedy unit cases, the registry.

The statistical tests follow vLLM's rejection-sampler tests: many seeded verdicts on a small
vocabulary, the emitted tokens compared with the exact target distribution. The target and
the draft are per-prefix tables (p and q at position 2 depend on the token at position 1),
and both the first emitted token and the joint law of the first two (one or two decode
steps) are checked against the exact p(a) and p(a) p(b | a) with the chi-square of
tests/stats_helpers.py: a right verifier must keep every p-value above 1e-6, each
deliberately broken one (written below, never in src/) must be rejected at p < 1e-12.
`SpeculativeVerifier.verify` makes the same draws as the batched `speculative_sample` on one
chain (tested below), so the 2 * 10^5 batched verdicts per case cover the per-step API.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from adaspec.core.proposal import Proposal
from adaspec.core.sampling import sample_rows
from adaspec.core.token_tree import TokenTree
from adaspec.errors import InputError
from adaspec.verify import (
    VERIFIERS,
    GreedyVerifier,
    MCNSVerifier,
    MCSSWithoutReplacementVerifier,
    SpeculativeVerifier,
    choose,
    speculative_sample,
)
from adaspec.verify.base import Verdict

from .stats_helpers import Fit, assert_caught, assert_exact, fit, tv, tv_bound  # noqa: F401 (tests/test_tree.py imports them from here)

N = 200_000
BatchVerify = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Generator],
    tuple[torch.Tensor, torch.Tensor],
]


# ---------------------------------------------------------------------------------------------
# Deliberately broken chain rules: the statistical check must reject every one of them.


def broken_chain(bug: str) -> BatchVerify:
    """`speculative_sample` with one classic mistake:
    accept_all: keep every drafted token (the output follows the draft);
    correction_from_p: right acceptance, but the correction drawn from p instead of
        norm(max(0, p - q));
    inverse_ratio: accept with min(1, q/p) instead of min(1, p/q)."""

    def sample(tokens, q, p, gen):
        batch, k = tokens.shape
        rows = torch.arange(batch)
        p_tok = p[:, :k].gather(2, tokens.unsqueeze(2)).squeeze(2)
        q_tok = torch.ones_like(p_tok) if q is None else q.gather(2, tokens.unsqueeze(2)).squeeze(2)
        u = torch.rand(batch, k, generator=gen, dtype=p.dtype)
        if bug == "accept_all":
            accept = torch.ones_like(p_tok, dtype=torch.bool)
        elif bug == "inverse_ratio":
            accept = u * p_tok < q_tok
        else:
            accept = u * q_tok < p_tok
        accepted = accept.long().cumprod(1).sum(1)
        p_next = p[rows, accepted]
        rejected = accepted < k
        if bug != "correction_from_p" and bool(rejected.any()):
            pos = accepted.clamp(max=k - 1)
            if q is None:
                residual = p_next.scatter(1, tokens[rows, pos].unsqueeze(1), 0.0)
            else:
                residual = (p_next - q[rows, pos]).clamp(min=0)
            residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, p_next)
            p_next = torch.where(rejected.unsqueeze(1), residual, p_next)
        return accepted, sample_rows(p_next, gen)

    sample.__name__ = bug
    return sample


BUGS = ["accept_all", "correction_from_p", "inverse_ratio"]
VARIANTS = ["right", *BUGS]


def chain_rule(variant: str) -> BatchVerify:
    return speculative_sample if variant == "right" else broken_chain(variant)


# ---------------------------------------------------------------------------------------------
# A toy language: per-prefix tables of distributions.


def categorical(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Draft sampling for the tests, independent of the library's sampler (and faster than
    torch.multinomial on 4 * 10^5 rows). Never returns a zero-probability token."""
    u = torch.rand(probs.shape[0], 1, generator=gen, dtype=torch.float64)
    cdf = probs.double().cumsum(1)
    pick = (cdf <= u * cdf[:, -1:]).sum(1)
    last = probs.shape[1] - 1 - (probs.flip(1) > 0).long().argmax(1)  # last positive token
    return torch.minimum(pick, last)


class Tables:
    """tables[L] is [V**L, V]: the distribution of the token after each length-L prefix."""

    def __init__(
        self,
        vocab: int,
        depth: int,
        seed: int,
        sharp: float,
        zeros: int = 0,
        blend: tuple[Tables, float] | None = None,
    ) -> None:
        """zeros: each row forbids that many random tokens (probability exactly 0).
        blend (other, w): the tables are (1 - w) * other + w * these (a draft close to
        `other`: the right and the broken rules then differ by a few percent)."""
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.tables = []
        for length in range(depth + 1):
            logits = torch.randn(vocab**length, vocab, generator=g) * sharp
            if zeros:
                banned = torch.rand(vocab**length, vocab, generator=g).argsort(1)[:, :zeros]
                logits.scatter_(1, banned, float("-inf"))
            table = logits.softmax(1)
            if blend is not None:
                other, w = blend
                table = (1 - w) * other.tables[length] + w * table
            self.tables.append(table)

    def rows(self, length: int, index: torch.Tensor) -> torch.Tensor:
        """Next-token distributions [B, V] after B prefixes of one length, given as base-V
        numbers `index` (prefix [a, b] is a * V + b)."""
        return self.tables[length][index]

    def first_two(self) -> torch.Tensor:
        """The exact law of the first two tokens, [V, V]."""
        return self.tables[1] * self.tables[0][0].unsqueeze(1)


def draft_chain(
    prefix: torch.Tensor,
    target: Tables,
    draft: Tables,
    k: int,
    gen: torch.Generator,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Draft k tokens after each of B prefixes; return (tokens, q [B,k,V] or None, p [B,k+1,V])."""
    batch, start = prefix.shape
    vocab = target.vocab
    index = (prefix * vocab ** torch.arange(start - 1, -1, -1)).sum(1)
    tokens = torch.empty(batch, k, dtype=torch.long)
    q = torch.empty(batch, k, draft.vocab)
    p = torch.empty(batch, k + 1, vocab)
    for j in range(k + 1):
        p[:, j] = target.rows(start + j, index)
        if j == k:
            break
        q[:, j] = draft.rows(start + j, index)
        tokens[:, j] = q[:, j].argmax(1) if deterministic else categorical(q[:, j], gen)
        index = index * vocab + tokens[:, j]
    return tokens, None if deterministic else q, p


def draft_and_verify(
    verify: BatchVerify,
    prefix: torch.Tensor,
    target: Tables,
    draft: Tables,
    k: int,
    gen: torch.Generator,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step for B prefixes: draft k tokens, score them, verify."""
    drafted, q, p = draft_chain(prefix, target, draft, k, gen, deterministic)
    accepted, nxt = verify(drafted, q, p, gen)
    return drafted, accepted, nxt


def emit_two(
    verify: BatchVerify,
    target: Tables,
    draft: Tables,
    k: int,
    seed: int,
    deterministic: bool = False,
    n: int = N,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Run the decode loop until each of n sequences has two tokens; return them and the
    acceptance rate of the first step."""
    gen = torch.Generator().manual_seed(seed)
    empty = torch.zeros(n, 0, dtype=torch.long)
    drafted, acc, nxt = draft_and_verify(verify, empty, target, draft, k, gen, deterministic)
    first = torch.where(acc >= 1, drafted[:, 0], nxt)
    second = torch.full_like(first, -1)
    if k >= 2:
        second = torch.where(acc >= 2, drafted[:, 1], second)
    second = torch.where(acc == 1, nxt, second)
    again = acc == 0  # only one token emitted: a second decode step after it
    d2, acc2, nxt2 = draft_and_verify(
        verify, first[again].unsqueeze(1), target, draft, k, gen, deterministic
    )
    second[again] = torch.where(acc2 >= 1, d2[:, 0], nxt2)
    assert bool((second >= 0).all())
    return first, second, float(acc.double().mean()) / k


def laws(first: torch.Tensor, second: torch.Tensor, target: Tables) -> list[Fit]:
    """The check: the first token against p(a), the first two against p(a) p(b | a)."""
    vocab = target.vocab
    return [fit(first, target.tables[0][0]), fit(first * vocab + second, target.first_two())]


def make_case(vocab, k, q_sharp, p_sharp, p_zeros, q_zeros, close):
    target = Tables(vocab, k + 1, seed=10 + vocab + k, sharp=p_sharp, zeros=p_zeros)
    blend = (target, close) if close else None
    draft = Tables(vocab, k + 1, seed=20 + vocab + k, sharp=q_sharp, zeros=q_zeros, blend=blend)
    return target, draft


CASES = [  # (vocab, k, draft sharpness, target sharpness, zeros in p, zeros in q, closeness)
    pytest.param(6, 1, 1.0, 1.5, 0, 0, 0, id="V6-k1"),
    pytest.param(6, 3, 1.0, 1.5, 0, 0, 0, id="V6-k3"),
    pytest.param(5, 2, 2.0, 1.0, 0, 0, 0, id="V5-k2-sharp-draft"),
    # q = 0 where p > 0 (reachable only through a correction) and p = 0 where q > 0
    pytest.param(6, 2, 1.0, 1.5, 2, 2, 0, id="V6-k2-zeros-in-p-and-q"),
    # q = 0.9 p + 0.1 r: 91% accepted, and correction_from_p moves the first token's law by
    # only TV 0.023 (rejected at p ~ 1e-95; 0.055 slipped through the earlier TV bound)
    pytest.param(6, 2, 1.0, 1.5, 1, 2, 0.1, id="V6-k2-draft-close-to-target"),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("vocab", "k", "q_sharp", "p_sharp", "p_zeros", "q_zeros", "close"), CASES)
def test_chain_rule_is_exact_and_broken_ones_are_caught(
    variant, vocab, k, q_sharp, p_sharp, p_zeros, q_zeros, close
):
    target, draft = make_case(vocab, k, q_sharp, p_sharp, p_zeros, q_zeros, close)
    p0, q0 = target.tables[0][0], draft.tables[0][0]
    if p_zeros:  # p = 0 where q > 0
        assert bool(((p0 == 0) & (q0 > 0)).any())
    if q_zeros and not close:  # q = 0 where p > 0
        assert bool(((q0 == 0) & (p0 > 0)).any())
    first, second, acceptance = emit_two(chain_rule(variant), target, draft, k, seed=1)
    fits = laws(first, second, target)
    if variant == "right":
        assert 0.05 < acceptance < 0.98  # both the accept and the reject paths ran
        assert_exact(fits, f"speculative sampling, {k=}")
    else:
        assert_caught(fits, variant)


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-probs", "deterministic"])
def test_the_gpu_control_flow_is_exact(monkeypatch, deterministic):
    """On a GPU the sampler reads nothing back: every `may_hold` answers True, so the
    residual is built and the correction drawn whether or not a chain rejected. The law of
    the emitted tokens is the target's on that path too."""
    import adaspec.verify.speculative as speculative

    monkeypatch.setattr(speculative, "may_hold", lambda flags: True)
    target, draft = make_case(6, 2, 1.0, 1.5, 2, 2, 0)
    first, second, acceptance = emit_two(speculative_sample, target, draft, 2, seed=5,
                                         deterministic=deterministic)
    assert 0.05 < acceptance < 0.98
    assert_exact(laws(first, second, target), "speculative sampling, device control flow")


@pytest.mark.parametrize("variant", ["right", "accept_all", "correction_from_p"])
def test_deterministic_draft(variant):
    """An n-gram style draft (draft_probs None: the drafted token counts as probability 1)
    keeps the target law; the broken rules do not."""
    vocab, k = 6, 3
    target = Tables(vocab, k + 1, seed=3, sharp=1.5)
    draft = Tables(vocab, k + 1, seed=4, sharp=1.0)
    first, second, _ = emit_two(chain_rule(variant), target, draft, k, seed=2, deterministic=True)
    fits = laws(first, second, target)
    if variant == "right":
        assert_exact(fits, "deterministic draft")
    else:
        assert_caught(fits, variant)


@pytest.mark.parametrize(("vq", "vp"), [(5, 7), (7, 5)])
def test_vocab_size_mismatch_is_zero_padded(vq, vp):
    """Target tokens the draft cannot produce still appear; draft-only tokens never do."""
    g = torch.Generator().manual_seed(vq * 10 + vp)
    p = (torch.randn(vp, generator=g, dtype=torch.float64) * 1.5).softmax(0)
    q = (torch.randn(vq, generator=g, dtype=torch.float64)).softmax(0)
    drafted = categorical(q.expand(N, vq), g).unsqueeze(1)
    acc, nxt = speculative_sample(drafted, q.expand(N, 1, vq), p.expand(N, 2, vp), g)
    first = torch.where(acc >= 1, drafted[:, 0], nxt)
    assert int(first.max()) < vp
    assert_exact([fit(first, p)], f"vocab {vq} -> {vp}")


def test_verify_is_the_batched_sampler_on_one_chain():
    """`verify` and `speculative_sample` agree draw for draw, so the statistics above cover
    the per-step API; cases include q = None and mismatched vocabularies."""
    g = torch.Generator().manual_seed(11)
    sampler = SpeculativeVerifier()
    for case in range(300):
        k = case % 4
        vp, vq = 6, (6, 4, 9)[case % 3]
        p = (torch.randn(k + 1, vp, generator=g) * 2).softmax(1)
        q = None if case % 5 == 0 else (torch.randn(k, vq, generator=g) * 2).softmax(1)
        tokens = torch.randint(min(vp, vq), (k,), generator=g).tolist()
        seed = int(torch.randint(2**31, (1,), generator=g))
        proposal = Proposal.chain(int(torch.randint(vp, (1,), generator=g)), tokens, q)
        verdict = sampler.verify(proposal, p, torch.Generator().manual_seed(seed))
        acc, nxt = speculative_sample(
            torch.tensor(tokens, dtype=torch.long).view(1, k),
            None if q is None else q.unsqueeze(0),
            p.unsqueeze(0),
            torch.Generator().manual_seed(seed),
        )
        assert verdict == Verdict(list(range(1, int(acc[0]) + 1)), int(nxt[0]))


def test_verify_method_is_exact_through_the_single_chain_api():
    """A direct check of the per-step `verify` on Proposal objects (a Python loop, so fewer
    samples)."""
    vocab, k, n = 6, 2, 5_000
    target = Tables(vocab, k, seed=5, sharp=1.5)
    draft = Tables(vocab, k, seed=6, sharp=1.0)
    gen = torch.Generator().manual_seed(3)
    sampler = SpeculativeVerifier()
    drafted, q, p = draft_chain(torch.zeros(n, 0, dtype=torch.long), target, draft, k, gen)
    assert q is not None
    firsts = []
    for i in range(n):
        verdict = sampler.verify(Proposal.chain(0, drafted[i].tolist(), q[i]), p[i], gen)
        assert verdict.path == list(range(1, verdict.accepted + 1))
        firsts.append(int(drafted[i, 0]) if verdict.accepted else verdict.next_token)
    assert_exact([fit(torch.tensor(firsts), target.tables[0][0])], "single-chain verify")


def test_equal_distributions_accept_everything():
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        assert SpeculativeVerifier().verify(Proposal.chain(1, [3, 0], p[:2]), p, gen).accepted == 2


def test_token_the_target_forbids_is_always_rejected():
    p = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.0, 0.0, 1.0]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        verdict = SpeculativeVerifier().verify(Proposal.chain(0, [2], q), p, gen)
        assert verdict.accepted == 0 and verdict.next_token in (0, 1)


def test_token_the_draft_never_proposes_is_accepted_whenever_drafted():
    """q(x) = 0 < p(x): min(1, p/q) is 1 (written without the division)."""
    p = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        assert SpeculativeVerifier().verify(Proposal.chain(0, [0], q), p, gen).accepted == 1


def test_all_zero_residual_falls_back_to_target():
    """q > p on the drafted token is impossible when q == p; force a rejection anyway."""
    p = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    q = torch.tensor([[0.0, 1.0]])
    gen = torch.Generator().manual_seed(0)
    # Drafted token 0 has p = 0: rejected, and max(0, p - q) is all zero.
    assert SpeculativeVerifier().verify(Proposal.chain(1, [0], q), p, gen) == Verdict([], 1)


def test_none_draft_probs_equals_one_hot():
    g = torch.Generator().manual_seed(1)
    p = torch.rand(4, 9, generator=g).softmax(1)
    tokens = [2, 7, 1]
    one_hot = F.one_hot(torch.tensor(tokens), 9).float()
    for seed in range(50):
        a = SpeculativeVerifier().verify(
            Proposal.chain(0, tokens), p, torch.Generator().manual_seed(seed)
        )
        b = SpeculativeVerifier().verify(
            Proposal.chain(0, tokens, one_hot), p, torch.Generator().manual_seed(seed)
        )
        assert a == b


def test_empty_draft_samples_the_bonus_row():
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    verdict = SpeculativeVerifier().verify(Proposal.chain(3, []), p, torch.Generator())
    assert verdict == Verdict([], 2)


def test_seeded_verdicts_are_reproducible():
    g = torch.Generator().manual_seed(7)
    p = torch.rand(5, 11, generator=g).softmax(1)
    q = torch.rand(4, 11, generator=g).softmax(1)
    proposal = Proposal.chain(0, [3, 1, 4, 1], q)

    def run(seed: int) -> list[Verdict]:
        gen = torch.Generator().manual_seed(seed)
        return [SpeculativeVerifier().verify(proposal, p, gen) for _ in range(30)]

    assert run(123) == run(123)
    assert run(123) != run(124)


def test_speculative_rejects_bad_inputs():
    p = torch.full((3, 4), 0.25)
    with pytest.raises(InputError, match="target_probs"):
        SpeculativeVerifier().verify(Proposal.chain(0, [1]), p, None)
    with pytest.raises(InputError, match="draft probs"):
        SpeculativeVerifier().verify(Proposal.chain(0, [1, 2], p), p, None)
    with pytest.raises(InputError, match="token ids"):
        SpeculativeVerifier().verify(Proposal.chain(0, [1, 9]), p, None)
    tree = Proposal(TokenTree([0, 1, 2], [-1, 0, 0]), p[:1], replacement=True)
    with pytest.raises(InputError, match="checks chains"):
        SpeculativeVerifier().verify(tree, p, None)
    with pytest.raises(InputError, match="draft_tokens"):
        speculative_sample(torch.tensor([1, 2]), None, p.unsqueeze(0), None)


# ---------------------------------------------------------------------------------------------
# Greedy


def one_hot_rows(ids: list[int], vocab: int = 8) -> torch.Tensor:
    return F.one_hot(torch.tensor(ids), vocab).float()


def greedy(tokens: list[int], rows: torch.Tensor, q: torch.Tensor | None = None) -> Verdict:
    return GreedyVerifier().verify(Proposal.chain(0, tokens, q), rows, None)


def test_greedy_all_accepted_gives_bonus():
    assert greedy([1, 2, 3], one_hot_rows([1, 2, 3, 5])) == Verdict([1, 2, 3], 5)


def test_greedy_first_rejected():
    assert greedy([4, 2, 3], one_hot_rows([1, 2, 3, 5])) == Verdict([], 1)


def test_greedy_middle_rejected_uses_argmax_of_soft_rows():
    rows = torch.tensor(
        [[0.1, 0.7, 0.2], [0.5, 0.2, 0.3], [0.2, 0.2, 0.6], [0.3, 0.4, 0.3]]
    )  # argmax 1, 0, 2, 1
    q = torch.full((3, 3), 1 / 3)  # ignored
    assert greedy([1, 0, 1], rows, q) == Verdict([1, 2], 2)
    assert greedy([], rows[:1]) == Verdict([], 1)
    assert greedy([1, 99], rows[:3]) == Verdict([1], 0)  # an out-of-vocabulary id never matches


def test_greedy_rejects_bad_shapes():
    with pytest.raises(InputError, match="target_probs"):
        greedy([1, 2], one_hot_rows([1, 2]))


# ---------------------------------------------------------------------------------------------
# Registry and the choice of a verifier


def test_registry_and_choose():
    assert isinstance(VERIFIERS["greedy"](), GreedyVerifier)
    assert isinstance(VERIFIERS["speculative"](), SpeculativeVerifier)
    with pytest.raises(InputError, match="unknown verifier 'magic'; known: greedy, speculative"):
        VERIFIERS["magic"]
    assert isinstance(choose(None, trees=False, greedy=True), GreedyVerifier)
    assert isinstance(choose("default", trees=False, greedy=None), GreedyVerifier)
    assert isinstance(choose(None, trees=False, greedy=False), SpeculativeVerifier)
    assert isinstance(choose(None, trees=True, greedy=False), MCSSWithoutReplacementVerifier)
    assert isinstance(choose("mcns", trees=True, greedy=False), MCNSVerifier)
    mine = MCNSVerifier()
    assert choose(mine, trees=True) is mine
    with pytest.raises(InputError, match="checks chains; a token tree needs verify="):
        choose("speculative", trees=True)
    with pytest.raises(InputError, match="only keeps the output exact at temperature 0"):
        choose("greedy", trees=False, greedy=False)
