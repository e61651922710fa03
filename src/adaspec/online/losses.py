"""Distillation losses between the target's distribution p and the draft's q (OSD's
ablation: forward KL, reverse KL, generalized JSD with beta).

p is recorded as its top-k probabilities; both distributions are compared on k + 1 outcomes,
the k tokens and "any other token" (p's tail mass against q's). Merging outcomes can only
lower a divergence, so each loss is a lower bound of the full-vocabulary one, equal to it
when k covers the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from adaspec.errors import InputError

LOSS_NAMES = ("fkl", "rkl", "jsd")
EPS = 1e-12


def coarse(logq: torch.Tensor, top_ids: torch.Tensor, top_probs: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, log q) over the k recorded tokens plus the rest: [n, k + 1] each. `logq` is the
    draft's log-softmax over the vocabulary [n, V]."""
    logq_top = logq.gather(-1, top_ids)
    q_rest = (1 - logq_top.exp().sum(-1, keepdim=True)).clamp_min(EPS)
    p_rest = (1 - top_probs.sum(-1, keepdim=True)).clamp_min(0.0)
    return torch.cat([top_probs, p_rest], -1), torch.cat([logq_top, q_rest.log()], -1)


def _kl(a: torch.Tensor, log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per row; terms with a = 0 contribute 0."""
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a)).sum(-1)


def forward_kl(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    return _kl(p, p.clamp_min(EPS).log(), logq)


def reverse_kl(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    return _kl(logq.exp(), logq, p.clamp_min(EPS).log())


def jsd(p: torch.Tensor, logq: torch.Tensor, beta: float) -> torch.Tensor:
    """beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q."""
    q = logq.exp()
    log_m = (beta * p + (1 - beta) * q).clamp_min(EPS).log()
    return beta * _kl(p, p.clamp_min(EPS).log(), log_m) + (1 - beta) * _kl(q, logq, log_m)


@dataclass(frozen=True)
class Loss:
    name: str
    beta: float = 0.5

    @property
    def text(self) -> str:
        return f"jsd:{self.beta:g}" if self.name == "jsd" else self.name

    @property
    def fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        if self.name == "fkl":
            return forward_kl
        if self.name == "rkl":
            return reverse_kl
        return lambda p, logq: jsd(p, logq, self.beta)

    def __call__(self, logq: torch.Tensor, top_ids: torch.Tensor,
                 top_probs: torch.Tensor) -> torch.Tensor:
        """The mean loss over rows."""
        p, lq = coarse(logq, top_ids, top_probs)
        return self.fn(p, lq).mean()


def parse_loss(text: str) -> Loss:
    """`fkl`, `rkl`, `jsd` or `jsd:BETA` (0 < BETA < 1; default 0.5)."""
    name, _, arg = text.strip().partition(":")
    if name not in LOSS_NAMES:
        raise InputError(f"unknown loss {text!r}: use fkl, rkl or jsd[:beta]")
    if name != "jsd":
        if arg:
            raise InputError(f"loss {name} takes no parameter (got {text!r})")
        return Loss(name)
    try:
        beta = float(arg) if arg else 0.5
    except ValueError:
        raise InputError(f"jsd's beta must be a number, got {arg!r}") from None
    if not 0 < beta < 1:
        raise InputError(f"jsd's beta must be in (0, 1), got {beta}")
    return Loss("jsd", beta)
