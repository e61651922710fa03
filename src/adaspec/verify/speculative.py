"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

Token i of the draft is accepted with probability min(1, p(x)/q(x)); at the first rejection
the correction is drawn from norm(max(0, p - q)); if every token is accepted a bonus token is
drawn from the last target row. Each emitted token is then distributed exactly as the target's
processed distribution p, whatever the draft q was.

The work is vectorised over a batch of chains (`speculative_sample`) so one decode step costs
a handful of tensor ops, and so the statistical tests can draw 10^5 verdicts in milliseconds
through the very code path `SpeculativeVerifier.verify` uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adaspec.core.proposal import Proposal
from adaspec.core.sampling import may_hold, sample_rows, uniforms
from adaspec.errors import InputError
from adaspec.verify.base import Verdict, Verifier, check_token_ids


def _pad_vocab(probs: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad the last dim: a token outside a model's vocabulary has probability 0 there."""
    extra = size - probs.shape[-1]
    return F.pad(probs, (0, extra)) if extra > 0 else probs


def speculative_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify B drafted chains at once.

    draft_tokens: [B, k] token ids. draft_probs: [B, k, Vq], or None for a deterministic
    drafter (q is one-hot on the drafted token). target_probs: [B, k + 1, Vp].
    Returns (accepted [B], next_token [B]) as int64 tensors. Draft and target vocabularies may
    differ in size; the shorter one is zero-padded.

    Random draws, all from `generator`: B x k uniforms at once, then one categorical draw per
    chain (the correction or the bonus token). Nothing is read back to the host: on a GPU
    the verdict stays there until the caller reads it (token ids are range-checked when
    they come from the host).
    """
    if draft_tokens.dim() != 2:
        raise InputError(f"draft_tokens must be [B, k], got {list(draft_tokens.shape)}")
    batch, k = draft_tokens.shape
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (batch, k + 1):
        raise InputError(
            f"target_probs must be [B, k + 1, V] = [{batch}, {k + 1}, V], "
            f"got {list(target_probs.shape)}"
        )
    if draft_probs is not None and (
        draft_probs.dim() != 3 or tuple(draft_probs.shape[:2]) != (batch, k)
    ):
        raise InputError(
            f"draft_probs must be [B, k, V] = [{batch}, {k}, V] or None, "
            f"got {list(draft_probs.shape)}"
        )

    dtype = torch.promote_types(target_probs.dtype, torch.float32)
    if draft_probs is not None:
        dtype = torch.promote_types(dtype, draft_probs.dtype)
    vocab = (
        target_probs.shape[-1]
        if draft_probs is None
        else max(target_probs.shape[-1], draft_probs.shape[-1])
    )
    p = _pad_vocab(target_probs.to(dtype), vocab)
    q = None if draft_probs is None else _pad_vocab(draft_probs.to(dtype), vocab)
    check_token_ids(draft_tokens, vocab, "draft")
    tokens = draft_tokens.to(device=p.device, dtype=torch.long)

    rows = torch.arange(batch, device=p.device)
    if k == 0:
        bonus = sample_rows(p[:, 0], generator)
        return torch.zeros(batch, dtype=torch.long, device=p.device), bonus

    p_tok = p[:, :k].gather(2, tokens.unsqueeze(2)).squeeze(2)  # [B, k]
    u = uniforms((batch, k), generator, dtype, p.device)
    # u < p/q written without the division: q(x) = 0 with p(x) > 0 accepts, p(x) = 0 rejects.
    if q is None:
        accept = u < p_tok
    else:
        accept = u * q[:, :k].gather(2, tokens.unsqueeze(2)).squeeze(2) < p_tok
    accepted = accept.long().cumprod(1).sum(1)  # length of the accepted prefix, [B]

    p_next = p[rows, accepted]  # the rejected position's row, or the bonus row
    rejected = accepted < k
    if may_hold(rejected):
        pos = accepted.clamp(max=k - 1)
        if q is None:
            residual = p_next.scatter(1, tokens[rows, pos].unsqueeze(1), 0.0)
        else:
            residual = (p_next - q[rows, pos]).clamp(min=0.0)
        # A rejection has probability sum(residual), so an all-zero residual (q >= p
        # everywhere, which only rounding allows once we got here) has no shape: fall back to p.
        usable = residual.sum(1) > torch.finfo(dtype).tiny
        residual = torch.where(usable.unsqueeze(1), residual, p_next)
        p_next = torch.where(rejected.unsqueeze(1), residual, p_next)
    next_token = sample_rows(p_next, generator)
    return accepted, next_token


class SpeculativeVerifier(Verifier):
    """Exact speculative sampling for one drafted chain (temperature > 0)."""

    name = "speculative"
    walks_trees = False
    summary = "speculative sampling: accept with min(1, p/q), correct from max(0, p - q)"

    def verify(
        self,
        proposal: Proposal,
        target_probs: torch.Tensor,
        generator: torch.Generator | None,
    ) -> Verdict:
        self.check(proposal, target_probs)
        k = proposal.depth
        draft_probs = proposal.probs
        if draft_probs is not None and (draft_probs.dim() != 2 or draft_probs.shape[0] != k):
            raise InputError(
                f"draft probs must be [k, V] = [{k}, V] or None, got {list(draft_probs.shape)}"
            )
        if draft_probs is not None:
            draft_probs = draft_probs.to(target_probs.device)
        accepted, next_token = speculative_sample(
            torch.tensor(proposal.tokens, dtype=torch.long).view(1, k),
            None if draft_probs is None else draft_probs.unsqueeze(0),
            target_probs.unsqueeze(0),
            generator,
        )
        n, token = torch.cat([accepted, next_token]).tolist()  # the step's one read
        return Verdict(list(range(1, n + 1)), token)
