"""Train a router artifact from collected data: rewards -> REINFORCE -> artifact."""

from __future__ import annotations

from collections import Counter

import torch

from adaspec.errors import InputError
from adaspec.lab.router.collection import RouterData
from adaspec.lab.router.reward import DEFAULT_COST, rewards
from adaspec.route.artifact import RouterArtifact
from adaspec.route.policy import TrainConfig, train_policy

# Our speculative arms are exact (similarity 1), so similarity only separates plain
# decoding; a small alpha lets the measured cost, which tells the arms apart, dominate.
DEFAULT_ALPHA = 0.1


def data_rewards(data: RouterData, alpha: float, cost: str = DEFAULT_COST):
    """The reward table: measured decode ms per token, or (cost `profile`) the same runs
    priced by the cost profile the data was priced with (`RouterData.with_profile`)."""
    ms = data.decode_ms_per_token
    if cost == "profile":
        if data.profile_ms_per_token is None:
            raise InputError("the profile cost prices each arm's recorded steps with a cost "
                             "profile: give one (--profile FILE|flat; `adaspec profile --out "
                             "FILE` measures this machine's)")
        ms = data.profile_ms_per_token
    return rewards(data.similarity, ms, data.params, alpha, cost)


def train_artifact(
    data: RouterData,
    alpha: float = DEFAULT_ALPHA,
    cost: str = DEFAULT_COST,
    config: TrainConfig | None = None,
) -> RouterArtifact:
    config = config or TrainConfig()
    result = train_policy(data.states, data_rewards(data, alpha, cost), config)
    with torch.no_grad():
        picks = result.policy.probs(torch.as_tensor(data.states)).argmax(-1).tolist()
    counts = Counter(data.arms[i] for i in picks)
    return RouterArtifact(
        arms=dict(data.methods),
        target=data.target,
        alpha=alpha,
        cost=cost,
        policy=result.policy,
        info={
            "train": config.to_dict(),
            "prompts": len(data),
            "categories": dict(Counter(data.categories)),
            "history": result.history,
            "train_choices": dict(counts),
            **({"profile": data.profile_source} if cost == "profile" else {}),
        },
    )
