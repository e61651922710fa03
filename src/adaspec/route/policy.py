"""The routing policy and its REINFORCE training (Huang et al.'s settings by default).

A 3-layer MLP (hidden 512, tanh) maps the target's final hidden state of the prompt to a
softmax over the arms. Inputs are standardised with the training set's mean and std (the
real model's final states have a few dimensions in the hundreds, which would saturate tanh).

Training is offline REINFORCE on (prompt, arm, reward) tuples: each step samples an arm per
prompt from the current policy, looks its reward up in the collected table, and follows
-(r - b) log pi(a | x), with the baseline b = the policy's expected reward on that prompt
(it does not depend on the sampled arm, so the gradient stays unbiased), advantages scaled
by their batch std. The optimum is the best arm per prompt, not a reward-weighted mixture.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import cast

import numpy as np
import torch
from torch import nn

from adaspec.errors import InputError

MODES = ("greedy", "dynamic")


@dataclass
class TrainConfig:
    lr: float = 1e-3
    weight_decay: float = 1e-2
    batch_size: int = 64
    epochs: int = 3
    hidden: int = 512
    seed: int = 0

    def check(self) -> None:
        if self.lr <= 0 or self.weight_decay < 0:
            raise InputError("lr must be > 0 and weight decay >= 0")
        if self.batch_size < 1 or self.epochs < 1 or self.hidden < 1:
            raise InputError("batch size, epochs and hidden size must be >= 1")

    def to_dict(self) -> dict:
        return asdict(self)


class RouterPolicy(nn.Module):
    """Standardise -> Linear -> tanh -> Linear -> tanh -> Linear -> logits over arms."""

    mean: torch.Tensor  # buffers, registered in __init__
    std: torch.Tensor

    def __init__(self, in_dim: int, n_arms: int, hidden: int = 512) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, n_arms),
        )
        self.register_buffer("mean", torch.zeros(in_dim))
        self.register_buffer("std", torch.ones(in_dim))

    @property
    def in_dim(self) -> int:
        return int(self.mean.numel())

    @property
    def n_arms(self) -> int:
        return int(cast(nn.Linear, self.net[-1]).out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x.float() - self.mean) / self.std)

    @torch.no_grad()
    def probs(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self(x), dim=-1)

    @torch.no_grad()
    def choose(
        self, state: torch.Tensor, mode: str = "greedy", generator: torch.Generator | None = None
    ) -> int:
        """Arm index for one prompt state [in_dim]: argmax (greedy) or a sample (dynamic)."""
        p = self.probs(state.reshape(1, -1))[0]
        if mode == "greedy":
            return int(p.argmax())
        if mode == "dynamic":
            return int(torch.multinomial(p, 1, generator=generator))
        raise InputError(f"unknown routing mode {mode!r}; use one of {', '.join(MODES)}")


@dataclass
class TrainResult:
    policy: RouterPolicy
    history: list[dict]  # per epoch: loss, expected reward under the policy


def train_policy(
    states: np.ndarray, rewards: np.ndarray, config: TrainConfig | None = None
) -> TrainResult:
    """REINFORCE on a [prompts, arms] reward table for [prompts, dim] prompt states."""
    config = config or TrainConfig()
    config.check()
    x = torch.as_tensor(np.asarray(states), dtype=torch.float32)
    r = torch.as_tensor(np.asarray(rewards), dtype=torch.float32)
    if x.ndim != 2 or r.ndim != 2 or x.shape[0] != r.shape[0] or x.shape[0] == 0:
        raise InputError(
            f"training needs states [N, dim] and rewards [N, arms] for N >= 1 prompts, got "
            f"{tuple(x.shape)} and {tuple(r.shape)}"
        )
    if not torch.isfinite(x).all() or not torch.isfinite(r).all():
        raise InputError("training data holds NaN or infinite values")
    g = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)  # the layers' initialisation
    policy = RouterPolicy(x.shape[1], r.shape[1], config.hidden)
    policy.mean.copy_(x.mean(0))
    policy.std.copy_(x.std(0, unbiased=False).clamp_min(1e-6))
    opt = torch.optim.AdamW(policy.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    history: list[dict] = []
    n = x.shape[0]
    for epoch in range(config.epochs):
        order = torch.randperm(n, generator=g)
        losses = []
        for start in range(0, n, config.batch_size):
            idx = order[start : start + config.batch_size]
            logp = torch.log_softmax(policy(x[idx]), dim=-1)
            arm = torch.multinomial(logp.exp().detach(), 1, generator=g)[:, 0]
            reward = r[idx, arm]
            baseline = (logp.exp().detach() * r[idx]).sum(-1)
            adv = reward - baseline
            if adv.numel() > 1 and adv.std() > 0:
                adv = adv / adv.std()
            loss = -(adv * logp.gather(1, arm[:, None])[:, 0]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            expected = float((policy.probs(x) * r).sum(-1).mean())
        history.append({"epoch": epoch + 1, "loss": float(np.mean(losses)), "reward": expected})
    policy.eval()
    return TrainResult(policy, history)
