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

from adaspec.errors import InputError
from adaspec.lab.bench.report import OVERALL, summarize
from adaspec.lab.router.collection import RouterData
from adaspec.lab.router.train_policy import train_artifact
from adaspec.route.policy import RouterPolicy, TrainConfig

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
        m: statistics.mean(v for c in cats if (v := out[c].get(m)) is not None)
        for m in out[OVERALL]
        if any(out[c].get(m) is not None for c in cats)
    }
    return out


def replay_scopes(test: RouterData, choices) -> tuple[float | None, float | None]:
    """(overall, mean over categories) replayed speedup of per-prompt picks."""
    table = speedups([*ar_rows(test), *routed_rows(test, choices, "routed")], ["routed"])
    return table[OVERALL].get("routed"), table[MEAN].get("routed")


def replay_speedup(test: RouterData, choices) -> float | None:
    return replay_scopes(test, choices)[0]


def _spread(values: list[float | None], prefix: str = "") -> dict:
    clean = [v for v in values if v is not None]
    return {
        f"{prefix}speedup": statistics.mean(clean) if clean else None,
        f"{prefix}min": min(clean) if clean else None,
        f"{prefix}max": max(clean) if clean else None,
    }


def learning_curve(
    train: RouterData,
    test: RouterData,
    sizes: list[int],
    alpha: float,
    cost: str,
    config: TrainConfig,
    draws: int = 5,
) -> list[dict]:
    """Replayed speedup of the greedy policy trained on n random training prompts (`draws`
    subsets per n, each with its own seed): overall (`speedup`, `min`, `max`) and mean over
    categories (`mean_speedup`, `mean_min`, `mean_max`). At n = all prompts the one draw
    trains on the data in its own order with `config.seed`, i.e. exactly the policy that
    `train_artifact(train, alpha, cost, config)` (and the alpha sweep) trains."""
    rng = np.random.default_rng(config.seed)
    out = []
    for n in sizes:
        overall, mean = [], []
        for d in range(draws if n < len(train) else 1):
            if n < len(train):
                idx = rng.choice(len(train), size=n, replace=False)
            else:
                idx = np.arange(len(train))
            cfg = TrainConfig(**{**config.to_dict(), "seed": config.seed + d})
            art = train_artifact(train.subset(idx), alpha, cost, cfg)
            o, m = replay_scopes(test, policy_choices(art.policy, test.states))
            overall.append(o)
            mean.append(m)
        out.append(
            {"prompts": n, **_spread(overall), **_spread(mean, "mean_"), "draws": len(overall)}
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
        overall, mean = replay_scopes(test, picks)
        out.append(
            {
                "alpha": a,
                "cost": cost,
                "speedup": overall,
                "mean_speedup": mean,
                "picks": dict(Counter(test.arms[int(i)] for i in picks)),
            }
        )
    return out


def proxy_vs_truth(train: RouterData, alpha: float) -> dict:
    """How often each reward's best arm is the measured fastest arm, on the training data."""
    from adaspec.lab.router.train_policy import data_rewards

    fastest = oracle_choices(train)
    out: dict = {"prompts": len(train), "fastest": dict(Counter(train.arms[i] for i in fastest))}
    for cost in (c for c in ("params", "measured", "profile") if c in train.costs):
        best = data_rewards(train, alpha, cost).argmax(axis=1)
        out[cost] = {
            "agrees_with_fastest": float(np.mean(best == fastest)),
            "best": dict(Counter(train.arms[i] for i in best)),
        }
    for key, table in (("mean_similarity", train.similarity), ("mean_speedup", train.speedup)):
        out[key] = dict(zip(train.arms, table.mean(0).round(4).tolist(), strict=True))
    return out


def timing_noise(test: RouterData, live_rows: list[dict]) -> dict:
    """Run-to-run timing noise from the bench itself: a live router row that ran one arm on
    every turn and produced the same tokens as that arm's own row of the same prompt is a
    second measurement of the same work. Ratio = the router row's ms/token, routing time
    taken out, over the arm row's."""
    ratios = []
    for row in live_rows:
        picks = set(row.get("route") or [])
        if len(picks) != 1:
            continue
        arm = next(iter(picks))
        ref = test.rows.get((row["prompt_id"], arm))
        if ref is None or not row["new_tokens"] or ref["token_ids"] != row["token_ids"]:
            continue
        wall = row["wall_time"] - (row.get("route_time") or 0.0)
        ratio = (wall / row["new_tokens"]) / (ref["wall_time"] / ref["new_tokens"])
        ratios.append({"prompt_id": row["prompt_id"], "method": row["method"], "arm": arm,
                       "ratio": ratio})
    dev = [abs(r["ratio"] - 1.0) for r in ratios]
    return {
        "pairs": len(ratios),
        "median_abs_deviation": statistics.median(dev) if dev else None,
        "max_abs_deviation": max(dev) if dev else None,
        "ratios": ratios,
    }


def cross_validate(
    train: RouterData,
    alphas: list[float],
    cost: str,
    config: TrainConfig,
    folds: int = 4,
) -> list[dict]:
    """Choose alpha (and see what the policy generalises to) without the test set: k-fold over
    the training prompts (random folds from `config.seed`), each fold's prompts routed by a
    policy trained on the other folds, replayed on their own measured runs."""
    if not 2 <= folds <= len(train):
        raise InputError(f"cross-validation needs 2 <= folds <= {len(train)} prompts, got {folds}")
    order = np.random.default_rng(config.seed).permutation(len(train))
    parts = np.array_split(order, folds)
    out = []
    for a in alphas:
        picks = np.zeros(len(train), dtype=int)
        for k, held in enumerate(parts):
            rest = np.concatenate([p for j, p in enumerate(parts) if j != k])
            art = train_artifact(train.subset(rest), a, cost, config)
            picks[held] = policy_choices(art.policy, train.states[held])
        overall, mean = replay_scopes(train, picks)
        out.append(
            {
                "alpha": a,
                "cost": cost,
                "folds": folds,
                "speedup": overall,
                "mean_speedup": mean,
                "fastest_share": float(np.mean(picks == oracle_choices(train))),
                "picks": dict(Counter(train.arms[int(i)] for i in picks)),
            }
        )
    return out


def choose_alpha(
    train: RouterData, alphas: list[float], cost: str, config: TrainConfig, folds: int = 4
) -> tuple[float, list[dict]]:
    """The alpha with the best cross-validated mean speedup over categories (the first of
    equals), and the whole cross-validation table."""
    rows = cross_validate(train, alphas, cost, config, folds)
    best = max(rows, key=lambda r: r["mean_speedup"] or 0.0)
    return best["alpha"], rows
