"""Verifiers: greedy unit cases, and statistical exactness of speculative sampling.

The statistical tests follow vLLM's rejection-sampler tests: draw many seeded verdicts on a
small vocabulary and compare the emitted tokens with the exact target distribution. The
target and the draft are fixed per-prefix tables, so p and q at position 2 depend on the token
at position 1, and the joint law of the first two emitted tokens (which may come from one or
two decode steps) is checked against the exact path probability p(a) p(b | a).

Bound. With N samples over C cells the empirical total variation (TV) distance has
E[TV] <= 0.5 * sqrt(C / N) (Cauchy-Schwarz), and one sample moves TV by at most 1/N, so by
McDiarmid P(TV > E[TV] + t) <= exp(-2 N t^2). `tv_bound` uses t for a one-in-a-million
false alarm. N = 2 * 10^5 gives 0.0086 for V = 6 and 0.0126 for the 36 two-token paths.
Measured: the right verifier 0.0007-0.0027 (first token) and 0.0025-0.0048 (two tokens); the
deliberately wrong ones 0.16 or more on two tokens, and the test demands three times the bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from adaspec.errors import InputError
from adaspec.verify import GreedyVerifier, SpeculativeSampler, get_verifier, speculative_sample
from adaspec.verify.base import Verdict, Verifier

N = 200_000
BatchVerify = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Generator],
    tuple[torch.Tensor, torch.Tensor],
]


def tv_bound(n: int, cells: int, false_alarm: float = 1e-6) -> float:
    """Upper bound on the TV distance of n exact samples from their law (see module doc)."""
    return 0.5 * math.sqrt(cells / n) + math.sqrt(math.log(1 / false_alarm) / (2 * n))


def tv(samples: torch.Tensor, exact: torch.Tensor) -> float:
    """TV distance between the empirical law of flat cell ids and the exact law."""
    counts = torch.bincount(samples, minlength=exact.numel()).double()
    return 0.5 * float((counts / samples.numel() - exact.flatten().double()).abs().sum())


# ---------------------------------------------------------------------------------------------
# Deliberately wrong verifiers: the statistical check must reject them.


def wrong_sample(
    mode: str,
    tokens: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Classic mistakes: resample from p on rejection, or accept with min(1, q/p)."""
    batch, k = tokens.shape
    rows = torch.arange(batch)
    p_tok = p[:, :k].gather(2, tokens.unsqueeze(2)).squeeze(2)
    q_tok = torch.ones_like(p_tok) if q is None else q.gather(2, tokens.unsqueeze(2)).squeeze(2)
    u = torch.rand(batch, k, generator=gen, dtype=p.dtype)
    accept = u * q_tok < p_tok if mode == "resample_from_p" else u * p_tok < q_tok
    accepted = accept.long().cumprod(1).sum(1)
    p_next = p[rows, accepted]
    if mode == "inverse_ratio" and q is not None:
        pos = accepted.clamp(max=k - 1)
        residual = (p_next - q[rows, pos]).clamp(min=0)
        residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, p_next)
        p_next = torch.where((accepted < k).unsqueeze(1), residual, p_next)
    return accepted, categorical(p_next / p_next.sum(1, keepdim=True), gen)


class WrongVerifier(Verifier):
    """A plausible but wrong speculative sampler, to prove the statistical check has power."""

    name = "wrong"

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def batch(self, tokens, q, p, gen):
        return wrong_sample(self.mode, tokens, q, p, gen)

    def verify(self, draft_tokens, draft_probs, target_probs, generator) -> Verdict:
        q = None if draft_probs is None else draft_probs.unsqueeze(0)
        acc, nxt = self.batch(torch.tensor([draft_tokens]), q, target_probs.unsqueeze(0), generator)
        return Verdict(int(acc[0]), int(nxt[0]))


RIGHT: BatchVerify = speculative_sample
WRONG = [WrongVerifier("resample_from_p"), WrongVerifier("inverse_ratio")]


# ---------------------------------------------------------------------------------------------
# A toy language: per-prefix tables of distributions.


def categorical(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Draft sampling for the tests, independent of the library's sampler (and faster than
    torch.multinomial on 4 * 10^5 rows)."""
    u = torch.rand(probs.shape[0], 1, generator=gen, dtype=torch.float64)
    return (probs.cumsum(1) <= u).sum(1).clamp(max=probs.shape[1] - 1)


class Tables:
    """tables[L] is [V**L, V]: the distribution of the token after each length-L prefix."""

    def __init__(self, vocab: int, depth: int, seed: int, sharp: float, zeros: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.tables = []
        for length in range(depth + 1):
            logits = torch.randn(vocab**length, vocab, generator=g) * sharp
            if zeros:
                # Each row forbids `zeros` random tokens (probability exactly 0).
                banned = torch.rand(vocab**length, vocab, generator=g).argsort(1)[:, :zeros]
                logits.scatter_(1, banned, float("-inf"))
            self.tables.append(logits.softmax(1))

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
    verify: BatchVerify, target: Tables, draft: Tables, k: int, seed: int, deterministic=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the decode loop until every one of N sequences has two tokens; return them."""
    gen = torch.Generator().manual_seed(seed)
    empty = torch.zeros(N, 0, dtype=torch.long)
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
    return first, second


def check(first, second, target: Tables) -> tuple[float, float]:
    vocab = target.vocab
    tv1 = tv(first, target.tables[0][0])
    tv2 = tv(first * vocab + second, target.first_two())
    return tv1, tv2


CASES = [  # (vocab, k, draft sharpness, target sharpness, zeros in p, also run the wrong ones)
    pytest.param(6, 1, 1.0, 1.5, 0, True, id="V6-k1"),
    pytest.param(6, 3, 1.0, 1.5, 0, True, id="V6-k3"),
    pytest.param(5, 2, 2.0, 1.0, 0, False, id="V5-k2"),
    pytest.param(8, 2, 1.0, 1.0, 0, False, id="V8-k2"),
    pytest.param(6, 2, 1.0, 1.5, 2, True, id="V6-k2-p-zero-where-q-positive"),
]


@pytest.mark.parametrize(("vocab", "k", "q_sharp", "p_sharp", "zeros", "wrong_too"), CASES)
def test_speculative_sampling_is_exact_and_wrong_ones_are_caught(
    vocab, k, q_sharp, p_sharp, zeros, wrong_too
):
    target = Tables(vocab, k + 1, seed=10 + vocab + k, sharp=p_sharp, zeros=zeros)
    draft = Tables(vocab, k + 1, seed=20 + vocab + k, sharp=q_sharp)
    bound1, bound2 = tv_bound(N, vocab), tv_bound(N, vocab * vocab)

    first, second = emit_two(RIGHT, target, draft, k, seed=1)
    tv1, tv2 = check(first, second, target)
    assert tv1 < bound1, f"first token: TV {tv1:.4f} >= {bound1:.4f}"
    assert tv2 < bound2, f"first two tokens: TV {tv2:.4f} >= {bound2:.4f}"
    if zeros:  # a token the target forbids is never emitted, however much the draft likes it
        assert float(target.first_two().flatten()[first * vocab + second].min()) > 0

    for wrong in WRONG if wrong_too else []:
        first, second = emit_two(wrong.batch, target, draft, k, seed=1)
        tv1w, tv2w = check(first, second, target)
        assert tv2w > 3 * bound2, f"{wrong.mode}: TV {tv2w:.4f} is not far above {bound2:.4f}"


def test_deterministic_draft_is_exact():
    """An n-gram style draft (draft_probs None) keeps the target law too."""
    vocab, k = 6, 3
    target = Tables(vocab, k + 1, seed=3, sharp=1.5)
    draft = Tables(vocab, k + 1, seed=4, sharp=1.0)
    first, second = emit_two(RIGHT, target, draft, k, seed=2, deterministic=True)
    tv1, tv2 = check(first, second, target)
    assert tv1 < tv_bound(N, vocab)
    assert tv2 < tv_bound(N, vocab * vocab)
    first, second = emit_two(WRONG[0].batch, target, draft, k, seed=2, deterministic=True)
    assert check(first, second, target)[1] > 3 * tv_bound(N, vocab * vocab)


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
    assert tv(first, p) < tv_bound(N, vp)


def test_verify_is_the_batched_sampler_on_one_chain():
    """`verify` and `speculative_sample` agree draw for draw, so the statistics above cover
    the per-step API; cases include q = None and mismatched vocabularies."""
    g = torch.Generator().manual_seed(11)
    sampler = SpeculativeSampler()
    for case in range(300):
        k = case % 4
        vp, vq = 6, (6, 4, 9)[case % 3]
        p = (torch.randn(k + 1, vp, generator=g) * 2).softmax(1)
        q = None if case % 5 == 0 else (torch.randn(k, vq, generator=g) * 2).softmax(1)
        tokens = torch.randint(min(vp, vq), (k,), generator=g).tolist()
        seed = int(torch.randint(2**31, (1,), generator=g))
        verdict = sampler.verify(tokens, q, p, torch.Generator().manual_seed(seed))
        acc, nxt = speculative_sample(
            torch.tensor(tokens, dtype=torch.long).view(1, k),
            None if q is None else q.unsqueeze(0),
            p.unsqueeze(0),
            torch.Generator().manual_seed(seed),
        )
        assert verdict == Verdict(int(acc[0]), int(nxt[0]))


def test_verify_method_is_exact_through_the_single_chain_api():
    """A direct check of the per-step `verify` (a Python loop, so fewer samples: the bound is
    0.054 for 5000 draws; here the right verifier measures 0.002, the wrong ones 0.10 and 0.55)."""
    vocab, k, n = 6, 2, 5_000
    target = Tables(vocab, k, seed=5, sharp=1.5)
    draft = Tables(vocab, k, seed=6, sharp=1.0)
    gen = torch.Generator().manual_seed(3)
    sampler = SpeculativeSampler()
    drafted, q, p = draft_chain(torch.zeros(n, 0, dtype=torch.long), target, draft, k, gen)
    assert q is not None
    firsts = []
    for i in range(n):
        verdict = sampler.verify(drafted[i].tolist(), q[i], p[i], gen)
        firsts.append(int(drafted[i, 0]) if verdict.accepted else verdict.next_token)
    assert tv(torch.tensor(firsts), target.tables[0][0]) < tv_bound(n, vocab)


def test_equal_distributions_accept_everything():
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        assert SpeculativeSampler().verify([3, 0], p[:2], p, gen).accepted == 2


def test_token_the_target_forbids_is_always_rejected():
    p = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.0, 0.0, 1.0]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        verdict = SpeculativeSampler().verify([2], q, p, gen)
        assert verdict.accepted == 0 and verdict.next_token in (0, 1)


def test_all_zero_residual_falls_back_to_target():
    """q > p on the drafted token is impossible when q == p; force a rejection anyway."""
    p = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    q = torch.tensor([[0.0, 1.0]])
    gen = torch.Generator().manual_seed(0)
    # Drafted token 0 has p = 0: rejected, and max(0, p - q) is all zero.
    assert SpeculativeSampler().verify([0], q, p, gen) == Verdict(0, 1)


def test_none_draft_probs_equals_one_hot():
    g = torch.Generator().manual_seed(1)
    p = torch.rand(4, 9, generator=g).softmax(1)
    tokens = [2, 7, 1]
    one_hot = torch.nn.functional.one_hot(torch.tensor(tokens), 9).float()
    for seed in range(50):
        a = SpeculativeSampler().verify(tokens, None, p, torch.Generator().manual_seed(seed))
        b = SpeculativeSampler().verify(tokens, one_hot, p, torch.Generator().manual_seed(seed))
        assert a == b


def test_empty_draft_samples_the_bonus_row():
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert SpeculativeSampler().verify([], None, p, torch.Generator().manual_seed(0)) == Verdict(
        0, 2
    )


def test_seeded_verdicts_are_reproducible():
    g = torch.Generator().manual_seed(7)
    p = torch.rand(5, 11, generator=g).softmax(1)
    q = torch.rand(4, 11, generator=g).softmax(1)
    tokens = [3, 1, 4, 1]

    def run(seed: int) -> list[Verdict]:
        gen = torch.Generator().manual_seed(seed)
        return [SpeculativeSampler().verify(tokens, q, p, gen) for _ in range(30)]

    assert run(123) == run(123)
    assert run(123) != run(124)


def test_speculative_rejects_bad_shapes():
    p = torch.full((3, 4), 0.25)
    with pytest.raises(InputError, match="target_probs"):
        SpeculativeSampler().verify([1], None, p, None)
    with pytest.raises(InputError, match="draft_probs"):
        SpeculativeSampler().verify([1, 2], p, p, None)
    with pytest.raises(InputError, match="token ids"):
        SpeculativeSampler().verify([1, 9], None, p, None)


# ---------------------------------------------------------------------------------------------
# Greedy


def one_hot_rows(ids: list[int], vocab: int = 8) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def test_greedy_all_accepted_gives_bonus():
    assert GreedyVerifier().verify([1, 2, 3], None, one_hot_rows([1, 2, 3, 5]), None) == Verdict(
        3, 5
    )


def test_greedy_first_rejected():
    assert GreedyVerifier().verify([4, 2, 3], None, one_hot_rows([1, 2, 3, 5]), None) == Verdict(
        0, 1
    )


def test_greedy_middle_rejected_uses_argmax_of_soft_rows():
    rows = torch.tensor(
        [[0.1, 0.7, 0.2], [0.5, 0.2, 0.3], [0.2, 0.2, 0.6], [0.3, 0.4, 0.3]]
    )  # argmax 1, 0, 2, 1
    q = torch.full((3, 3), 1 / 3)  # ignored
    assert GreedyVerifier().verify([1, 0, 1], q, rows, None) == Verdict(2, 2)
    assert GreedyVerifier().verify([], None, rows[:1], None) == Verdict(0, 1)


def test_greedy_rejects_bad_shapes():
    with pytest.raises(InputError, match="target_probs"):
        GreedyVerifier().verify([1, 2], None, one_hot_rows([1, 2]), None)


def test_registry():
    assert isinstance(get_verifier("greedy"), GreedyVerifier)
    assert isinstance(get_verifier("speculative"), SpeculativeSampler)
    with pytest.raises(InputError, match="greedy, speculative"):
        get_verifier("magic")
