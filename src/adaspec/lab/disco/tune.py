"""Choose tau and SL_max by simulated latency on the validation split, and tune the
baselines the same way (best static k; the confidence rule's threshold and bound), so every
method is tuned on the same data with the same costs (timed here, or a cost profile's).
DISCO's cost rule (`stop=cost`) is tuned beside them: it has no threshold, only its cap and
its guess of the next token's acceptance (`disco-cost` in the tables)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from adaspec.backends.base import ModelBackend
from adaspec.control.disco import GUESSES
from adaspec.control.disco_artifact import DiscoArtifact
from adaspec.control.disco_classifier import DiscoClassifier
from adaspec.control.disco_features import FeatureSpec, assemble
from adaspec.errors import InputError
from adaspec.lab.disco.dataset import Sample
from adaspec.lab.disco.simulate import (
    DEFAULT_SL_MAXES,
    NEVER_STOP,
    ORACLE_CAP,
    Costs,
    SimResult,
    measure_costs,
    simulate_all,
)

DEFAULT_TAUS = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 .. 0.95


@torch.inference_mode()
def disco_scores(
    sample: Sample, classifier: DiscoClassifier, spec: FeatureSpec, positions: int
) -> torch.Tensor:
    """[n, positions]: P(accepted) of token i if it were drafted at draft position d."""
    n = len(sample.hits)
    dist = (_by_position(sample, positions) if sample.depths else
            sample.dist.unsqueeze(1).expand(n, positions, sample.dist.shape[-1]))
    x = assemble(dist, torch.arange(positions)[None, :], torch.arange(n)[:, None], spec)
    return classifier.accept_probability(x)


def confidence_scores(sample: Sample, positions: int) -> torch.Tensor:
    """[n, positions]: the draft's top probability (the same at every draft position for a
    model draft)."""
    if sample.depths:
        return _by_position(sample, positions)[..., 0]
    return sample.dist[:, :1].expand(len(sample.hits), positions)


def _within_depth(samples: Sequence[Sample], cap: int) -> int:
    """The oracle's cap, within the draft lengths per-position samples describe."""
    return min([cap, *(s.depths for s in samples if s.depths)])


def _by_position(sample: Sample, positions: int) -> torch.Tensor:
    """A per-position sample's features [n, positions, F]."""
    if positions > sample.depths:
        raise InputError(f"the data describes drafts of up to {sample.depths} tokens, not "
                         f"{positions}: collect it deeper or tune a smaller SL_max")
    return sample.dist[:, :positions]


def _best(table: list[dict]) -> dict:
    """Lowest simulated ms/token; ties go to the shorter draft, then the higher threshold."""
    return top(table, 1)[0]


def _row(threshold: float, sl_max: int, res: SimResult) -> dict:
    return {"threshold": threshold, "sl_max": sl_max, **res.to_dict()}


def _cost_row(sl_max: int, guess: str, res: SimResult) -> dict:
    """A row of DISCO's cost rule: no threshold (NEVER_STOP in the column), its guess."""
    return {**_row(NEVER_STOP, sl_max, res), "stop": "cost", "guess": guess}


def tune(
    samples: Sequence[Sample],
    costs: Costs,
    classifier: DiscoClassifier,
    spec: FeatureSpec,
    taus: Sequence[float] = DEFAULT_TAUS,
    sl_maxes: Sequence[int] = DEFAULT_SL_MAXES,
    oracle_cap: int = ORACLE_CAP,
) -> dict:
    """Simulated latency of every setting on `samples`; the best of each family."""
    positions = max(sl_maxes)
    oracle_cap = _within_depth(samples, oracle_cap)
    hits = [s.hit_table() for s in samples]
    d_scores = [disco_scores(s, classifier, spec, positions) for s in samples]
    c_scores = [confidence_scores(s, positions) for s in samples]
    nones = [None] * len(samples)
    static = [
        _row(NEVER_STOP, k, simulate_all(hits, nones, NEVER_STOP, k, costs)) for k in sl_maxes
    ]
    disco = [_row(t, k, simulate_all(hits, d_scores, t, k, costs)) for t in taus for k in sl_maxes]
    conf = [_row(t, k, simulate_all(hits, c_scores, t, k, costs)) for t in taus for k in sl_maxes]
    cost_rule = [
        _cost_row(k, g, simulate_all(hits, d_scores, NEVER_STOP, k, costs, stop="cost", guess=g))
        for g in GUESSES
        for k in sl_maxes
    ]
    oracle = simulate_all(hits, nones, NEVER_STOP, oracle_cap, costs, oracle=True)
    ar = costs.step_ms(0)  # plain decoding: one target forward per token
    return {
        "prompts": len(samples),
        "tokens": sum(len(h) for h in hits),
        "costs": costs.to_dict(),
        "ar_ms_per_token": ar,
        "static": static,
        "disco": disco,
        "confidence": conf,
        "disco-cost": cost_rule,
        "oracle": {"sl_max": oracle_cap, **oracle.to_dict()},
        "best": {
            "static": _best(static),
            "disco": _best(disco),
            "confidence": _best(conf),
            "disco-cost": _best(cost_rule),
        },
    }


def evaluate(
    samples: Sequence[Sample],
    costs: Costs,
    classifier: DiscoClassifier,
    spec: FeatureSpec,
    settings: dict[str, dict],
    oracle_cap: int = ORACLE_CAP,
) -> dict[str, dict]:
    """Simulated latency of fixed settings (e.g. the tuned ones, on the test split):
    settings = {"disco": {"threshold", "sl_max"}, "static": {...}, "confidence": {...},
    "disco-cost": {"sl_max", "guess"}} (any subset)."""
    oracle_cap = _within_depth(samples, oracle_cap)
    hits = [s.hit_table() for s in samples]
    out: dict[str, dict] = {}
    for family, st in settings.items():
        k, t = int(st["sl_max"]), float(st.get("threshold", NEVER_STOP))
        if family == "disco-cost":
            guess = str(st.get("guess", "last"))
            scores: list[torch.Tensor | None] = [disco_scores(s, classifier, spec, k)
                                                 for s in samples]
            res = simulate_all(hits, scores, NEVER_STOP, k, costs, stop="cost", guess=guess)
            out[family] = _cost_row(k, guess, res)
            continue
        if family == "disco":
            scores = [disco_scores(s, classifier, spec, k) for s in samples]
        elif family == "confidence":
            scores = [confidence_scores(s, k) for s in samples]
        else:
            scores, t = [None] * len(samples), NEVER_STOP
        out[family] = _row(t, k, simulate_all(hits, scores, t, k, costs))
    oracle = simulate_all(hits, [None] * len(samples), NEVER_STOP, oracle_cap, costs, oracle=True)
    out["oracle"] = {"sl_max": oracle_cap, **oracle.to_dict()}
    return out


def confirm(
    candidates: Sequence[dict],
    run: Callable[[float, int], float],
) -> list[dict]:
    """Real runs of the best simulated settings: `run(threshold, sl_max)` returns measured
    ms/token on the validation prompts; rows come back with `measured_ms_per_token`, best
    measured first."""
    out = [{**c, "measured_ms_per_token": run(c["threshold"], c["sl_max"])} for c in candidates]
    return sorted(out, key=lambda r: r["measured_ms_per_token"])


def top(table: Sequence[dict], n: int) -> list[dict]:
    """The n settings with the lowest simulated ms/token (ties: shorter draft, then the
    higher threshold)."""
    key = lambda r: (round(r["ms_per_token"], 6), r["sl_max"], -r["threshold"])  # noqa: E731
    return sorted(table, key=key)[:n]


def measure_step_costs(
    art: DiscoArtifact,
    val: Sequence[Sample],
    target: ModelBackend,
    draft: ModelBackend,
    sl_max: int = max(DEFAULT_SL_MAXES),
    repeats: int = 5,
    log: Callable[[str], None] = print,
) -> Costs:
    """Per-forward costs on this machine, on the context of a typical validation prompt,
    and the cost of one DISCO decision (features + classifier) on a full-vocabulary row."""
    from adaspec.control.disco import DiscoLength

    lengths = sorted(val, key=lambda s: len(s.prompt_ids) + len(s.output))
    typical = lengths[len(lengths) // 2]
    probe = DiscoLength(art)
    row = torch.randn(draft.vocab_size)
    log(f"timing forwards on a {len(typical.prompt_ids) + len(typical.output)}-token context")
    costs = measure_costs(
        target,
        draft,
        typical.prompt_ids + typical.output,
        max(sl_max, ORACLE_CAP),
        repeats,
        decision=lambda: probe.keep_drafting(0, row),
    )
    log(
        f"measured: draft {costs.draft_ms:.1f} ms, target {costs.target_ms[0]:.1f} ms (1 token) "
        f"/ {costs.target(sl_max + 1):.1f} ms ({sl_max + 1} tokens), DISCO decision "
        f"{costs.decision_ms:.3f} ms"
    )
    return costs


def tune_artifact(
    art: DiscoArtifact,
    val: Sequence[Sample],
    costs: Costs,
    sl_max: int = max(DEFAULT_SL_MAXES),
    confirm_n: int = 0,
    run: Callable[[float, int], float] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Simulate every (tau, SL_max) on `val` with `costs`, keep the fastest in `art` (after
    real runs of the `confirm_n` best through `run(tau, sl_max) -> ms/token`, if asked),
    with the whole tuning record; returns that record."""
    from adaspec.lab.disco.train_classifier import classification_metrics

    result = tune(val, costs, art.classifier, art.spec, DEFAULT_TAUS, range(1, sl_max + 1))
    chosen = result["best"]["disco"]
    if confirm_n:
        if run is None:
            raise InputError("confirming settings needs real runs (models loaded)")
        result["confirmed"] = confirm(top(result["disco"], confirm_n), run)
        chosen = result["confirmed"][0]
        log(
            "confirmed: "
            + ", ".join(
                f"tau {r['threshold']} SL_max {r['sl_max']}: "
                f"{r['measured_ms_per_token']:.0f} ms/token "
                f"(simulated {r['ms_per_token']:.0f})"
                for r in result["confirmed"]
            )
        )
    art.tau, art.sl_max = float(chosen["threshold"]), int(chosen["sl_max"])
    result["val_prompts"] = [s.prompt_id for s in val]
    result["chosen"] = {"threshold": art.tau, "sl_max": art.sl_max}
    art.tuning = result
    art.metrics["val_at_tau"] = classification_metrics(val, art.classifier, art.spec, art.tau)
    return result


def measured_run(
    art: DiscoArtifact,
    samples: Sequence[Sample],
    target: ModelBackend,
    tokenizer,
    draft: ModelBackend,
    eos_token_ids: list[int],
) -> Callable[[float, int], float]:
    """`run(tau, sl_max)` for `confirm`: real DISCO runs over `samples`' prompts."""
    return lambda t, k: _measure(art, t, k, samples, target, tokenizer, draft, eos_token_ids)


def _measure(
    art: DiscoArtifact,
    tau: float,
    sl_max: int,
    samples: Sequence[Sample],
    target: ModelBackend,
    tokenizer,
    draft: ModelBackend,
    eos_token_ids: list[int],
) -> float:
    """Real ms/token of DISCO at (tau, sl_max) over `samples`' prompts and budgets."""
    from adaspec.control.disco import DiscoLength
    from adaspec.draft.model import ModelDrafter
    from adaspec.engine.loop import Engine

    engine = Engine(
        target, tokenizer, ModelDrafter(draft), DiscoLength(art, tau, sl_max), None, eos_token_ids
    )
    engine.generate(samples[0].prompt_ids, 4)  # warm-up
    wall = tokens = 0.0
    for s in samples:
        res = engine.generate(s.prompt_ids, len(s.output))
        wall += res.stats.wall_time
        tokens += res.stats.new_tokens
    return 1000 * wall / tokens if tokens else 0.0
