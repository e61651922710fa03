"""Which way of drafting one token a step with a two-exit head gives the most tokens per
millisecond (issue 66, part 5), *predicted* from the held-out positions `head_exits.py`
scored (each exit's top probability and whether its top token was the target's) and a cost
model: a target call of 1 row (`c1`) or 2 rows (`c2`), exit 1's step (`h1`) and exit 2's on
top of it (`h2`), all in ms.

    .venv/bin/python experiments/head_exit_policies.py --run experiments/results/head-exits-X \
        --costs "epyc-avx512=24.8,36.5,2.4,2.0" --costs "h200=3.89,4.31,0.25,0.2"

Each answer position is one step drafting at most one token (the head's best plan on these
CPUs, `head:k=1`); a step that drafts and is right gives 2 tokens. Policies:
`ar` never drafts; `exit1` / `exit2` always draft from that exit; `conf1:t` drafts exit 1's
token when its top probability is >= t (what `auto` does with the head), `conf2:t` the same
with exit 2 (both exits run every step); `s2d:t1/t2` takes
exit 1's token when p1 >= t1, else runs exit 2 and drafts its token when p2 >= t2 (S2D's
exit rule, with the same stop as `auto`). Thresholds are chosen on half the positions and
scored on the other half (two folds, averaged), so no policy is scored on what chose it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

GRID = [i / 20 for i in range(21)]


def rate(t: torch.Tensor, cost: tuple[float, float, float, float], policy: str,
         t1: float = 0.0, t2: float = 0.0) -> float:
    """Tokens per ms over positions t [n, 4] (p1, hit1, hit2, p2)."""
    c1, c2, h1, h2 = cost
    p1, hit1, hit2, p2 = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
    n = t.shape[0]
    if policy == "ar":
        return n / (n * c1)
    if policy == "exit1":
        return float((1 + hit1).sum() / (n * (c2 + h1)))
    if policy == "exit2":
        return float((1 + hit2).sum() / (n * (c2 + h1 + h2)))
    if policy == "conf1":
        d = p1 >= t1
        return float((1 + hit1 * d).sum() / (h1 * n + torch.where(d, c2, c1).sum()))
    if policy == "conf2":
        d = p2 >= t1
        return float((1 + hit2 * d).sum() / ((h1 + h2) * n + torch.where(d, c2, c1).sum()))
    if policy == "s2d":
        use1 = p1 >= t1
        use2 = ~use1 & (p2 >= t2)
        tokens = 1 + hit1 * use1 + hit2 * use2
        spent = h1 * n + h2 * (~use1).sum() + torch.where(use1 | use2, c2, c1).sum()
        return float(tokens.sum() / spent)
    raise ValueError(policy)


def best(t: torch.Tensor, cost, policy: str) -> tuple[float, float]:
    if policy in ("conf1", "conf2"):
        return max(((a, 0.0) for a in GRID), key=lambda x: rate(t, cost, policy, *x))
    return max(((a, b) for a in GRID for b in GRID), key=lambda x: rate(t, cost, policy, *x))


def score(t: torch.Tensor, cost) -> dict:
    """Each policy's tokens per ms over ar's, thresholds chosen on the other fold."""
    folds = [t[0::2], t[1::2]]
    out: dict[str, dict] = {}
    ar = rate(t, cost, "ar")
    for policy in ("exit1", "exit2"):
        out[policy] = {"vs_ar": rate(t, cost, policy) / ar}
    for policy in ("conf1", "conf2", "s2d"):
        scored, chosen = [], []
        for k in (0, 1):
            th = best(folds[k], cost, policy)
            chosen.append(th)
            scored.append(rate(folds[1 - k], cost, policy, *th) / rate(folds[1 - k], cost, "ar"))
        out[policy] = {"vs_ar": sum(scored) / 2, "thresholds": chosen}
    out["s2d_vs_best_single_exit"] = out["s2d"]["vs_ar"] / max(
        *(out[k]["vs_ar"] for k in ("exit1", "exit2", "conf1", "conf2")))
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run", required=True, help="a head_exits.py output folder")
    p.add_argument("--costs", action="append", required=True,
                   help="NAME=c1,c2,h1,h2 in ms (a 1-row and a 2-row target call, exit 1's "
                        "step, exit 2's on top)")
    args = p.parse_args()
    run = Path(args.run)
    t = torch.load(run / "positions.pt")
    report = {"command": "python " + " ".join(sys.argv), "positions": int(t.shape[0]),
              "predicted": True, "by_cost": {}}
    for spec in args.costs:
        name, values = spec.split("=", 1)
        cost = tuple(float(v) for v in values.split(","))
        if len(cost) != 4:
            raise SystemExit(f"--costs {spec}: give c1,c2,h1,h2")
        report["by_cost"][name] = {"costs_ms": cost, **score(t, cost)}
    (run / "policies.json").write_text(json.dumps(report, indent=1))
    for name, r in report["by_cost"].items():
        print(name, {k: (round(v["vs_ar"], 3) if isinstance(v, dict) else round(v, 3))
                     for k, v in r.items() if k != "costs_ms"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
