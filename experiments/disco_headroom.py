"""Where DISCO's headroom over static k goes on this machine: three checks in simulation, on
the Spec-Bench and HumanEval test prompts of both DISCO runs (`disco-epyc`: first test split;
`disco-epyc-heldout`: held-out prompts), with the artifacts and costs tuned there.

1. Other stopping rules on the same classifier, each tuned on validation by simulated
   latency: stop when the product of the acceptance probabilities so far falls below a
   threshold; stop when the expected extra tokens of one more draft token are worth less than
   its marginal cost (at a tuned value per token); one threshold per draft position.
2. More features: the share of hits among the last 4 and 16 tokens before the step starts
   (teacher-forced), added to DISCO's features, classifier trained and tuned the same way.
3. Another verification cost curve: the target's cost for n tokens growing by a fixed
   25 or 50 ms per token, as on hardware whose verification reads the weights once for up
   to 9 tokens, instead of the measured curve (torch's CPU int8 kernel works on blocks of 4
   rows, so a 5-token verification costs about 1.8x a 4-token one). Static k, DISCO's tau
   and SL_max are re-tuned on validation at those costs.

    python experiments/disco_headroom.py > experiments/results/disco-epyc-heldout/headroom.txt
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from adaspec.control.disco_artifact import DiscoArtifact
from adaspec.control.disco_classifier import DiscoClassifier
from adaspec.control.disco_features import assemble
from adaspec.lab.disco.dataset import DiscoData, Sample
from adaspec.lab.disco.simulate import Costs, SimResult, best_schedule
from adaspec.lab.disco.train_classifier import train_classifier
from adaspec.lab.disco.tune import DEFAULT_TAUS, evaluate, tune

RESULTS = "experiments/results"
POSITIONS = 8  # draft positions, as SL_max's largest value
WINDOWS = (4, 16)  # history features: hit share over these many preceding tokens

TAU_GRID = [(t, k) for t in DEFAULT_TAUS for k in range(1, POSITIONS + 1)]  # (tau, SL_max)

# A rule sees the scores of the tokens drafted so far in this step and says: draft another.
Rule = Callable[[list[float]], bool]


def feature_grid(sample: Sample, art: DiscoArtifact) -> torch.Tensor:
    """[n, POSITIONS, features]: token i's features if drafted at draft position d."""
    n = len(sample.hits)
    dist = sample.dist.unsqueeze(1).expand(n, POSITIONS, sample.dist.shape[-1])
    return assemble(dist, torch.arange(POSITIONS)[None, :], torch.arange(n)[:, None], art.spec)


def history(hits: list[bool], p: int) -> list[float]:
    """Hit share of the WINDOWS tokens before position p (0.5 with none yet)."""
    out = []
    for w in WINDOWS:
        seg = hits[max(1, p - w) : p]
        out.append(sum(seg) / len(seg) if seg else 0.5)
    return out


def step_scores(
    model: DiscoClassifier, grid: torch.Tensor, hits: list[bool], p: int, limit: int, hist: bool
) -> list[float]:
    """Acceptance probabilities of the tokens a step from p would draft, up to `limit`."""
    x = torch.stack([grid[p + d, d] for d in range(limit)])
    if hist:
        x = torch.cat([x, torch.tensor(history(hits, p)).expand(limit, -1)], dim=1)
    return model.accept_probability(x).tolist()


@torch.inference_mode()
def simulate_rule(
    samples: Sequence[tuple[list[bool], torch.Tensor]],
    model: DiscoClassifier,
    rule: Rule,
    sl_max: int,
    costs: Costs,
    hist: bool = False,
) -> float:
    """Simulated ms/token of drafting under `rule` (as `simulate.simulate`, any rule)."""
    total = SimResult()
    for hits, grid in samples:
        n, p = len(hits), 1
        while p < n:
            limit = min(sl_max, n - p - 1)
            scores = step_scores(model, grid, hits, p, limit, hist) if limit else []
            drafted = 0
            while drafted < limit:
                drafted += 1
                if not rule(scores[:drafted]):
                    break
            accepted = 0
            while accepted < drafted and hits[p + accepted]:
                accepted += 1
            total.add_step(costs, drafted, accepted, decide=True)
            p += accepted + 1
    return total.ms_per_token


def threshold(tau: float) -> Rule:
    """DISCO's rule: draft another token while the last one's score reaches tau."""
    return lambda s: s[-1] >= tau


def floor_ms(hits_list: Sequence[list[bool]], costs: Costs) -> float:
    """The floor (`simulate.best_schedule`) over several generations, ms/token."""
    total = SimResult()
    for hits in hits_list:
        total.add(best_schedule(hits, costs, POSITIONS))
    return total.ms_per_token


def rules(costs: Costs) -> dict[str, tuple[Callable[..., Rule], list[tuple]]]:
    """Each family: a rule maker and its grid of (parameters..., SL_max)."""

    def cumulative(tau: float, _k: int) -> Rule:
        return lambda s: math.prod(s) >= tau

    def cost_aware(value: float, _k: int) -> Rule:
        def keep(s: list[float]) -> bool:
            d = len(s)
            if d >= POSITIONS:
                return False
            # the next token's acceptance guessed as this one's
            return math.prod(s) * s[-1] * value >= costs.step_ms(d + 1) - costs.step_ms(d)

        return keep

    return {
        "DISCO (threshold)": (lambda t, _k: threshold(t), TAU_GRID),
        "cumulative product": (cumulative, TAU_GRID),
        "expected gain vs cost": (cost_aware, [(v, POSITIONS) for v in range(50, 1500, 25)]),
    }


def tune_rule(val, model, make: Callable[..., Rule], grid: list[tuple], costs, hist=False):
    """The grid point with the lowest simulated ms/token on `val`: (rule, parameters)."""
    best = min(grid, key=lambda g: simulate_rule(val, model, make(*g), g[-1], costs, hist))
    return make(*best), best


def print_row(label: str, sets: dict, model, rule: Rule, sl_max: int, costs, hist=False) -> None:
    got = {k: simulate_rule(d, model, rule, sl_max, costs, hist) for k, d in sets.items()}
    print(f"- {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()))


def tune_per_position(val, model, costs) -> tuple:
    """Thresholds per draft position for each SL_max <= 4, by coordinate descent from 0.5."""
    options = [0.0, *DEFAULT_TAUS, 1.01]
    best: tuple[float, tuple] = (float("inf"), ())
    for k in range(1, 5):
        taus = [0.5] * k
        for _ in range(2):
            for i in range(k):
                trials = [(*taus[:i], t, *taus[i + 1 :]) for t in options]
                ms = [simulate_rule(val, model, per_position(t), k, costs) for t in trials]
                taus[i] = options[ms.index(min(ms))]
        got = simulate_rule(val, model, per_position(tuple(taus)), k, costs)
        best = min(best, (got, (*taus, k)))
    return best[1]


def per_position(taus: tuple) -> Rule:
    """Draft another token while this position's threshold is met (at most len(taus))."""
    return lambda s: len(s) < len(taus) and s[-1] >= taus[len(s) - 1]


def prepared(samples: list[Sample], art: DiscoArtifact) -> list[tuple[list[bool], torch.Tensor]]:
    return [([bool(h) for h in s.hits.tolist()], feature_grid(s, art)) for s in samples]


def history_rows(data, art: DiscoArtifact) -> tuple[torch.Tensor, torch.Tensor]:
    """Training rows with history features: steps drafted until the first miss (at most
    POSITIONS tokens), every drafted token a row labelled by its hit."""
    xs, ys = [], []
    for hits, grid in data:
        n, p = len(hits), 1
        while p < n:
            h = torch.tensor(history(hits, p))
            drafted = 0
            while drafted < min(POSITIONS, n - p):
                xs.append(torch.cat([grid[p + drafted, drafted], h]))
                ys.append(hits[p + drafted])
                drafted += 1
                if not ys[-1]:
                    break
            accepted = drafted if ys[-1] else drafted - 1
            p += accepted + 1
    return torch.stack(xs), torch.tensor(ys)


def stopping_rules(art: DiscoArtifact, costs: Costs, val, sets: dict) -> None:
    print("### 1. stopping rules on DISCO's classifier\n")
    chosen = {
        name: tune_rule(val, art.classifier, make, grid, costs)
        for name, (make, grid) in rules(costs).items()
    }
    taus_k = tune_per_position(val, art.classifier, costs)
    chosen["per-position thresholds"] = (per_position(taus_k[:-1]), taus_k)
    for name, (rule, params) in chosen.items():
        label = f"{name} {tuple(round(p, 2) for p in params)}"
        print_row(label, sets, art.classifier, rule, params[-1], costs)
    for k, d in sets.items():
        print(f"- floor on {k}: {floor_ms([hits for hits, _ in d], costs):.1f}")


def history_features(art: DiscoArtifact, costs: Costs, train, val, sets: dict) -> None:
    print("\n### 2. history features (hit share of the last 4 and 16 tokens)\n")
    x_tr_all, y_tr = history_rows(train, art)
    x_va_all, y_va = history_rows(val, art)
    for hist in (False, True):
        width = x_tr_all.shape[1] if hist else art.spec.size
        x_tr, x_va = x_tr_all[:, :width], x_va_all[:, :width]
        model = train_classifier(x_tr, y_tr, x_va, y_va, hidden=32, epochs=400).model
        rule, (tau, k) = tune_rule(val, model, lambda t, _k: threshold(t), TAU_GRID, costs, hist)
        label = "with history" if hist else "without (same rows)"
        print_row(f"{label}, tau {tau} SL_max {k}", sets, model, rule, k, costs, hist)


def cost_curves(art: DiscoArtifact, costs: Costs, val: list[Sample], tests: dict) -> None:
    print("\n### 3. verification cost curves (static k and DISCO re-tuned on val)\n")
    one = costs.target_ms[0]
    curves = {
        "measured": costs.target_ms,
        **{
            f"+{step} ms per token": [one + step * i for i in range(len(costs.target_ms))]
            for step in (50, 25)
        },
    }
    for name, target_ms in curves.items():
        c = Costs(costs.draft_ms, list(target_ms), costs.decision_ms)
        best = tune(val, c, art.classifier, art.spec)["best"]
        cells = []
        for tname, samples in tests.items():
            settings = {"static": best["static"], "disco": best["disco"]}
            ev = evaluate(samples, c, art.classifier, art.spec, settings)
            st, di = ev["static"]["ms_per_token"], ev["disco"]["ms_per_token"]
            floor = floor_ms([s.hits.tolist() for s in samples], c)
            cells.append(
                f"{tname}: static {st:.0f}, DISCO {di:.0f} ({100 * (di / st - 1):+.1f}%), "
                f"floor {floor:.0f}"
            )
        print(
            f"- {name} (static k={best['static']['sl_max']}, DISCO tau "
            f"{best['disco']['threshold']} SL_max {best['disco']['sl_max']}): " + "; ".join(cells)
        )


def main() -> None:
    first = DiscoData.load(f"{RESULTS}/disco-epyc/data.pt")
    held = DiscoData.load(f"{RESULTS}/disco-epyc-heldout/data.pt")
    for suite in ("spec-bench", "humaneval"):
        art = DiscoArtifact.load(f"{RESULTS}/disco-epyc/{suite}.pt")
        costs = Costs(**art.tuning["costs"])
        val_samples = first.split("val", suite)
        tests = {"first test": first.split("test", suite), "held-out": held.split("test", suite)}
        val = prepared(val_samples, art)
        sets = {"val": val, **{k: prepared(v, art) for k, v in tests.items()}}
        print(f"## {suite} (simulated ms/token; tuned on {len(val)} validation prompts)\n")
        stopping_rules(art, costs, val, sets)
        history_features(art, costs, prepared(first.split("train", suite), art), val, sets)
        cost_curves(art, costs, val_samples, tests)
        print()


if __name__ == "__main__":
    main()
