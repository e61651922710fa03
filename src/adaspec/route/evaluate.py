"""Replay routing decisions on measured runs: the oracle router, a trained policy's picks,
learning curves and alpha sweeps, all from runs already measured (every arm on every test
prompt in one bench run), so no configuration is decoded twice.

Replayed speedups use the same pooled definition as the bench (plain decoding's ms/token over
the routed ms/token on the same prompts): the routed row of a prompt is the measured row of
the arm picked for it. The replay leaves out routing time (tens of microseconds for the
MLP); the live router rows of the bench include it. The oracle takes, per prompt, the arm
with the lowest measured time, so it also profits from timing noise: an upper bound.
"""

from __future__ import annotations

import statistics
from collections import Counter

import numpy as np
import torch

from adaspec.bench.report import OVERALL, summarize
from adaspec.route.data import RouterData
from adaspec.route.policy import RouterPolicy, TrainConfig
from adaspec.route.train import train_artifact

ORACLE = "oracle router"
MEAN = "mean over categories"


def policy_choices(policy: RouterPolicy, states: np.ndarray) -> np.ndarray:
    """The greedy policy's arm index per prompt."""
    with torch.no_grad():
        return policy.probs(torch.as_tensor(states)).argmax(-1).numpy()


def oracle_choices(data: RouterData) -> np.ndarray:
    return data.ms_per_token.argmin(axis=1)


def routed_rows(data: RouterData, choices, name: str) -> list[dict]:
    """The measured row of the picked arm for every prompt, renamed to `name`."""
    return [
        {**data.rows[(p, data.arms[int(c)])], "method": name}
        for p, c in zip(data.prompt_ids, choices, strict=True)
    ]


def ar_rows(data: RouterData) -> list[dict]:
    return [data.rows[(p, "ar")] for p in data.prompt_ids]


def speedups(rows: list[dict], methods: list[str]) -> dict[str, dict[str, float | None]]:
    """{scope: {method: speedup}} per category and overall (the bench's definition), plus
    `mean over categories`."""
    summary = summarize(rows, ["ar", *[m for m in methods if m != "ar"]])
    out: dict[str, dict[str, float | None]] = {
        cat: {m: e["speedup"] for m, e in per.items()}
        for cat, per in summary["categories"].items()
    }
    out[OVERALL] = {m: e["speedup"] for m, e in summary["methods"].items()}
    cats = [c for c in out if c != OVERALL]
    out[MEAN] = {
        m: statistics.mean(out[c][m] for c in cats if out[c].get(m) is not None)  # type: ignore[misc]
        for m in out[OVERALL]
        if any(out[c].get(m) is not None for c in cats)
    }
    return out


def replay_speedup(test: RouterData, choices) -> float | None:
    return speedups([*ar_rows(test), *routed_rows(test, choices, "routed")], ["routed"])[
        OVERALL
    ]["routed"]


def learning_curve(
    train: RouterData,
    test: RouterData,
    sizes: list[int],
    alpha: float,
    cost: str,
    config: TrainConfig,
    draws: int = 5,
) -> list[dict]:
    """Overall replayed speedup of the greedy policy trained on n random training prompts
    (`draws` subsets per n, each with its own seed)."""
    rng = np.random.default_rng(config.seed)
    out = []
    for n in sizes:
        values = []
        for d in range(draws if n < len(train) else 1):
            idx = rng.choice(len(train), size=n, replace=False)
            cfg = TrainConfig(**{**config.to_dict(), "seed": config.seed + d})
            art = train_artifact(train.subset(idx), alpha, cost, cfg)
            values.append(replay_speedup(test, policy_choices(art.policy, test.states)))
        clean = [v for v in values if v is not None]
        out.append(
            {
                "prompts": n,
                "speedup": statistics.mean(clean) if clean else None,
                "min": min(clean) if clean else None,
                "max": max(clean) if clean else None,
                "draws": len(values),
            }
        )
    return out


def alpha_sweep(
    train: RouterData, test: RouterData, alphas: list[float], cost: str, config: TrainConfig
) -> list[dict]:
    """Greedy policy trained on all training prompts at each alpha, replayed on the test."""
    out = []
    for a in alphas:
        art = train_artifact(train, a, cost, config)
        picks = policy_choices(art.policy, test.states)
        out.append(
            {
                "alpha": a,
                "cost": cost,
                "speedup": replay_speedup(test, picks),
                "picks": dict(Counter(test.arms[int(i)] for i in picks)),
            }
        )
    return out


def proxy_vs_truth(train: RouterData, alpha: float) -> dict:
    """How often each reward's best arm is the measured fastest arm, on the training data."""
    from adaspec.route.train import data_rewards

    fastest = oracle_choices(train)
    out: dict = {"prompts": len(train), "fastest": dict(Counter(train.arms[i] for i in fastest))}
    for cost in ("params", "measured"):
        best = data_rewards(train, alpha, cost).argmax(axis=1)
        out[cost] = {
            "agrees_with_fastest": float(np.mean(best == fastest)),
            "best": dict(Counter(train.arms[i] for i in best)),
        }
    for key, table in (("mean_similarity", train.similarity), ("mean_speedup", train.speedup)):
        out[key] = dict(zip(train.arms, table.mean(0).round(4).tolist(), strict=True))
    return out
