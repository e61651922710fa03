"""The DISCO report: measured latency per category for DISCO and its baselines, the share of
the static-to-oracle gap DISCO closes, F1 of the classifier beside the best static length,
transfer between suites, and what the latency simulation predicted on the same test split.

Measured = the bench rows of one run. Simulated = `lab.disco.simulate` on the test split's
teacher-forced hits with the per-forward costs measured while tuning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from adaspec.control.disco_artifact import DiscoArtifact
from adaspec.lab.bench.report import SCOPES, method_entry, row_key
from adaspec.lab.disco.dataset import DiscoData, Sample
from adaspec.lab.disco.simulate import (
    DEFAULT_SL_MAXES,
    ORACLE_CAP,
    Costs,
    SimResult,
    best_schedule,
    price_run,
)
from adaspec.lab.disco.train_classifier import classification_metrics
from adaspec.lab.disco.tune import evaluate


@dataclass(frozen=True)
class Arm:
    label: str
    method: str
    family: str  # ar | static | confidence | disco | disco-cost | heuristic | oracle | sweep
    artifact: str | None = None  # label of the artifact whose tuning it comes from



def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def gap_closed(static_ms: float | None, disco_ms: float | None, oracle_ms: float | None):
    """Share of the static-to-oracle latency gap that DISCO closes (1 = as fast as the
    oracle, 0 = no better than static, negative = slower than static)."""
    if static_ms is None or disco_ms is None or oracle_ms is None or static_ms <= oracle_ms:
        return None
    return (static_ms - disco_ms) / (static_ms - oracle_ms)


DECIDING = ("disco", "disco-cost")  # families whose classifier decides after every token


def _entry(rows: list[dict], arm, costs: Costs | None = None) -> dict | None:
    ar_by_key = {row_key(r): r for r in rows if r["method"] == "ar"}
    mine = [r for r in rows if r["method"] == arm.method]
    if not mine:
        return None
    e = method_entry(mine, ar_by_key)
    keys = tuple(f"{scope}{k}" for scope in SCOPES for k in ("ms_per_token", "speedup")) + (
        "mean_accepted_tokens", "acceptance_rate")
    priced, priced_speedup = (None, None) if costs is None else _priced(
        mine, ar_by_key, costs, decides=arm.family in DECIDING
    )
    return {k: e[k] for k in keys} | {
        "priced_ms_per_token": priced,
        "priced_speedup": priced_speedup,
        "mean_draft_length": e["mean_draft_length"],
        "draft_calls": e["draft_calls"],
        "target_calls": e["target_calls"],
        "prompts": e["prompts"],
    }


def _priced(
    rows: list[dict], ar_by_key: dict, costs: Costs, decides: bool
) -> tuple[float | None, float | None]:
    """ms/token of the rows priced at `costs`, and the speedup over their paired plain rows
    priced the same way (None where a run cannot be priced)."""
    prices = [price_run(r, costs, decides) for r in rows]
    if None in prices:
        return None, None
    ms = sum(cast("list[float]", prices)) / sum(r["new_tokens"] for r in rows)  # no None
    pairs = [
        (ar_by_key[row_key(r)], p, r)
        for r, p in zip(rows, prices, strict=True)
        if row_key(r) in ar_by_key
    ]
    plain = [price_run(a, costs) for a, _, _ in pairs]
    if not pairs or None in plain:
        return ms, None
    plain_ms = sum(cast("list[float]", plain)) / sum(a["new_tokens"] for a, _, _ in pairs)
    my_ms = (sum(cast(float, p) for _, p, _ in pairs)  # prices hold no None (checked above)
             / sum(r["new_tokens"] for _, _, r in pairs))
    return ms, plain_ms / my_ms if my_ms else None


# Latency figures the comparisons read: the three measured scopes and the priced decode.
COMPARED = (*SCOPES, "priced_")


def _scope_table(rows: list[dict], arms, home: str | None, costs: Costs | None = None) -> dict:
    """Measured entries of every arm over `rows`; the comparison uses the baselines tuned
    on `home` (the suite the scope belongs to), DISCO in-domain and in transfer."""
    out: dict = {"arms": {a.label: _entry(rows, a, costs) for a in arms}}

    def ms(label: str | None, field: str = "ms_per_token") -> float | None:
        e = out["arms"].get(label) if label else None
        return e.get(field) if e else None

    def pick(family: str, artifact: str | None) -> str | None:
        for a in arms:
            if a.family == family and (artifact is None or a.artifact == artifact):
                return a.label
        return None

    disco_arms = [a for a in arms if a.family == "disco"]
    in_domain = next((a for a in disco_arms if a.artifact == home), None) or (
        disco_arms[0] if disco_arms else None
    )
    base = in_domain.artifact if in_domain else None
    static, conf = pick("static", base), pick("confidence", base)
    heur, oracle = pick("heuristic", None), pick("oracle", None)
    cost_rule = pick("disco-cost", base)
    out["compare"] = {
        "home_artifact": base,
        "static": static,
        "confidence": conf,
        "disco": in_domain.label if in_domain else None,
        "transfer": [a.label for a in disco_arms if a is not in_domain],
    }
    if cost_rule is not None:
        out["compare"]["disco_cost"] = cost_rule
    # end to end, without the target's prompt prefill, the decode steps alone, priced
    for prefix in COMPARED:
        field = f"{prefix}ms_per_token"
        d = ms(in_domain.label, field) if in_domain else None
        out[f"{prefix}disco_vs_static"] = _ratio(d, ms(static, field))
        out[f"{prefix}disco_vs_heuristic"] = _ratio(d, ms(heur, field))
        if cost_rule is not None:
            c = ms(cost_rule, field)
            out[f"{prefix}disco_cost_vs_static"] = _ratio(c, ms(static, field))
            out[f"{prefix}disco_cost_vs_disco"] = _ratio(c, d)
        out[f"{prefix}gap_closed"] = {
            a.label: gap_closed(ms(static, field), ms(a.label, field), ms(oracle, field))
            for a in disco_arms
        }
    return out


IN_DOMAIN = "in domain"
_DATA_KEYS = ("suites", "prompts", "tokens", "max_new_tokens", "generated_with")


def _in_domain_table(
    rows: list[dict], arms, suite_of: dict[str, str], suites: list[str], costs: Costs | None = None
) -> dict | None:
    """All suites at once, each suite's prompts run with the static k, confidence rule and
    DISCO tuned on that suite (the comparison the issue asks for "on average"); None when a
    suite has no artifact of its own."""
    virtual: list[Arm] = []
    relabelled: list[dict] = []
    families = ["static", "confidence", "disco"]
    if any(a.family == "disco-cost" for a in arms):
        families.append("disco-cost")
    for family in families:
        own = {s: next((a for a in arms if a.family == family and a.artifact == s), None)
               for s in suites}
        if any(a is None for a in own.values()):
            return None
        arm_of = cast("dict[str, Arm]", own)  # no None (checked just above)
        label = f"{family} [{IN_DOMAIN}]"
        virtual.append(Arm(label, f"<{label}>", family, IN_DOMAIN))
        relabelled += [
            r | {"method": virtual[-1].method}
            for r in rows
            if r["method"] == arm_of[suite_of.get(r["category"], "")].method
        ]
    shared = [a for a in arms if a.family in ("ar", "heuristic", "oracle")]
    return _scope_table(rows + relabelled, shared + virtual, IN_DOMAIN, costs)


def _mean_of_suites(measured: dict, suites: list[str]) -> dict:
    """The mean over suites of each in-domain comparison ratio (each suite weighs the same,
    however many tokens its prompts produced)."""
    out: dict = {}
    for prefix in COMPARED:
        for key in (f"{prefix}disco_vs_static", f"{prefix}disco_vs_heuristic",
                    f"{prefix}disco_cost_vs_static"):
            vals: list[Any] = [  # ratios, or None where a suite has none
                t.get(key) if t["compare"]["home_artifact"] == s else None
                for s, t in ((s, measured[f"{s} (all)"]) for s in suites)
            ]
            out[key] = None if None in vals or not vals else sum(vals) / len(vals)
    if all(v is None for k, v in out.items() if "disco_cost" in k):  # no cost-rule arms
        out = {k: v for k, v in out.items() if "disco_cost" not in k}
    return out


def disco_report(
    bench_summary: dict,
    rows: list[dict],
    arms,
    artifacts: Sequence[tuple[str, DiscoArtifact]],
    test: Sequence[Sample],
    data: DiscoData,
) -> dict:
    suite_of = {s.category: s.suite for s in test}
    categories = list(dict.fromkeys(r["category"] for r in rows))
    suites = list(dict.fromkeys(suite_of.get(c, "?") for c in categories))
    trained = {a.artifact for a in arms if a.artifact}  # artifact labels = training suites

    def home_of(suite: str) -> str | None:
        return suite if suite in trained else None

    # one yardstick for pricing every arm's calls: the first artifact's timed costs
    costs = Costs(**artifacts[0][1].tuning["costs"]) if artifacts else None
    measured: dict = {}
    for c in categories:
        measured[c] = _scope_table(
            [r for r in rows if r["category"] == c], arms, home_of(suite_of.get(c, "")), costs
        )
    for s in suites:
        cats = {c for c in categories if suite_of.get(c) == s}
        measured[f"{s} (all)"] = _scope_table(
            [r for r in rows if r["category"] in cats], arms, home_of(s), costs
        )
    in_domain = None
    if len(suites) > 1:
        measured["overall"] = _scope_table(rows, arms, None, costs)
        in_domain = _in_domain_table(rows, arms, suite_of, suites, costs)

    arts: dict = {}
    for path, art in artifacts:
        label = "+".join(art.provenance.get("train_suites") or ["?"])
        val = art.metrics.get("val", {})
        static_k = val.get("static_k")
        costs = Costs(**art.tuning["costs"])
        best = art.tuning["best"]
        settings = {
            "disco": {"threshold": art.tau, "sl_max": art.sl_max},
            "static": best["static"],
            "confidence": best["confidence"],
        }
        if any(a.family == "disco-cost" for a in arms):  # the rule as the bench ran it
            from adaspec.control.disco import COST_SL_MAX, tuned_cost_rule

            settings["disco-cost"] = {"sl_max": COST_SL_MAX, "guess": "last",
                                      **tuned_cost_rule(art)}
        f1_test: dict = {}
        sim_test: dict = {}
        for s in suites:
            mine = [x for x in test if x.suite == s]
            if not mine:
                continue
            f1_test[s] = classification_metrics(
                mine, art.classifier, art.spec, 0.5, static_k=static_k
            )
            sim = evaluate(mine, costs, art.classifier, art.spec, settings)
            sweep = evaluate(
                mine,
                costs,
                art.classifier,
                art.spec,
                {f"k={k}": {"threshold": -1.0, "sl_max": k} for k in DEFAULT_SL_MAXES},
            )
            floor = SimResult()
            for x in mine:
                floor.add(best_schedule(x.hits.tolist(), costs, ORACLE_CAP))
            sim_test[s] = {
                **sim,
                "best_schedule": floor.to_dict(),
                "sweep": {k: v for k, v in sweep.items() if k != "oracle"},
                "ar_ms_per_token": costs.target(1),
            }
        arts[label] = {
            "path": path,
            "train_suites": art.provenance.get("train_suites"),
            "train_rows": art.metrics.get("train_rows"),
            "tau": art.tau,
            "sl_max": art.sl_max,
            "feature_spec": art.spec.to_dict(),
            "best_static_k": best["static"]["sl_max"],
            "confidence": best["confidence"],
            "costs": art.tuning["costs"],
            "val_f1": val,
            "test_f1": f1_test,
            "simulated_test": sim_test,
            "confirmed": art.tuning.get("confirmed"),
        }
    cfg = bench_summary.get("config", {})
    first = artifacts[0][1]
    train_data = first.provenance.get("data") or data.provenance
    return {
        "setup": {
            "target": cfg.get("target"),
            "draft": cfg.get("draft"),
            "dtype": cfg.get("dtype"),
            # a summary written before issue 32 names the weights `quant` / `draft_quant`
            "weights": f"{cfg.get('weights', cfg.get('quant', 'none'))}/"
                       f"{cfg.get('draft_weights', cfg.get('draft_quant', 'none'))}",
            "max_new_tokens": cfg.get("max_new_tokens"),
            "test_prompts": len({r["prompt_id"] for r in rows}),
            "categories": {c: suite_of.get(c) for c in categories},
            "data": {k: train_data.get(k) for k in _DATA_KEYS},
            "splits": {
                "train": len(first.provenance.get("train_prompts", [])),
                "val": len(first.provenance.get("val_prompts", [])),
                "test": len(data.split("test")),
            },
            "held_out_data": None if data.provenance == train_data else {
                k: data.provenance.get(k) for k in (*_DATA_KEYS, "excluded")
            },
            "machine": bench_summary.get("machine"),
        },
        "measured": measured,
        "overall_in_domain": in_domain,
        "mean_of_suites": _mean_of_suites(measured, suites),
        "artifacts": arts,
        "exactness": {
            k: bench_summary.get("exactness", {}).get(k)
            for k in ("checked", "differs", "numerical_ties", "bugs", "tie_tolerance")
        },
    }


# ------------------------------------------------------------------------ markdown
def _f(v, fmt=".0f", suffix="") -> str:
    return "n/a" if v is None else f"{v:{fmt}}{suffix}"


def _pct_change(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{100 * (ratio - 1):+.1f}%"


def _measured_table(measured: dict, prefix: str) -> list[str]:
    """One row per scope, one cell per arm: ms/token (speedup), decode or end to end."""
    labels = list(next(iter(measured.values()))["arms"])
    lines = ["| scope | " + " | ".join(f"`{lab}`" for lab in labels) + " |",
             "| --- |" + " ---: |" * len(labels)]
    for scope, t in measured.items():
        cells = []
        for lab in labels:
            e = t["arms"].get(lab)
            cells.append("n/a" if not e else f"{_f(e.get(prefix + 'ms_per_token'))} "
                         f"({_f(e.get(prefix + 'speedup'), '.2f', 'x')})")
        lines.append(f"| {scope} | " + " | ".join(cells) + " |")
    return lines


def _has_figure(measured: dict, prefix: str) -> bool:
    """Whether any drafting arm has this figure (rows from before the draft's prefill was
    timed apart have no steady one)."""
    return any(
        e and e.get(f"{prefix}ms_per_token") is not None and label != "plain"
        for t in measured.values()
        for label, e in t["arms"].items()
    )


# The comparison columns, in the order shown.
_SHOWN = ("decode_", "steady_", "", "priced_")


def _change_cells(t: dict) -> list[str]:
    """DISCO's change against the best static k, then the heuristic, in every figure."""
    return [
        _pct_change(t.get(f"{p}disco_vs_{vs}")) for vs in ("static", "heuristic") for p in _SHOWN
    ]


def _cost_rule_lines(scopes: dict, mean: dict) -> list[str]:
    """DISCO's cost rule against the best static k and DISCO's threshold (bench runs with
    --stop-cost only)."""
    rows = [(scope, t) for scope, t in scopes.items() if t["compare"].get("disco_cost")]
    if not rows:
        return []
    lines = [
        "",
        "## DISCO's cost rule (stop=cost) against the best static k and DISCO's threshold",
        "",
        "Latency change of the in-domain cost rule (negative = the cost rule faster).",
        "",
        "| scope | vs best static: decode | steady | end to end | priced | vs DISCO (tau): "
        "decode | steady | end to end | priced |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for scope, t in rows:
        cells = [_pct_change(t.get(f"{p}disco_cost_vs_{vs}")) for vs in ("static", "disco")
                 for p in _SHOWN]
        lines.append(f"| {scope} | " + " | ".join(cells) + " |")
    if any(mean.get(f"{p}disco_cost_vs_static") is not None for p in _SHOWN):
        cells = [_pct_change(mean.get(f"{p}disco_cost_vs_static")) for p in _SHOWN]
        lines.append("| mean of suites | " + " | ".join(cells) + " |  |  |  |  |")
    return lines


def to_markdown(report: dict) -> str:
    st = report["setup"]
    lines = [
        "# DISCO: dynamic speculation length (issue 4)",
        "",
        f"Target `{st['target']}`, draft `{st['draft']}`, {st['dtype']}, weights "
        f"target/draft {st.get('weights', st.get('quant'))}; greedy; "
        f"{st['max_new_tokens']} new tokens; {st['test_prompts']} test prompts. Training data: "
        f"{st['data'].get('suites')} ({st['data'].get('prompts')} prompts, "
        f"{st['data'].get('tokens')} tokens of {st['data'].get('max_new_tokens')}-token greedy "
        f"outputs, made with `{st['data'].get('generated_with')}`), split by prompt "
        f"{st['splits']}.",
    ]
    held = st.get("held_out_data")
    if held:
        lines[-1] += (
            f" Test prompts: a held-out collection, {held.get('suites')} without the prompts of "
            f"{held.get('excluded')} ({held.get('prompts')} prompts)."
        )
    lines += [
        "",
        "**Measured** below = one `adaspec bench` run on the test split (all methods in one "
        "process, alternating prompt by prompt after a warm-up; speedup = paired ms/token of "
        "plain decoding over the method's). **Simulated** = the latency model of "
        "`adaspec.lab.disco.simulate` (teacher-forced hits x per-forward costs timed on this "
        "machine while tuning); tau, SL_max, the best static k and the confidence threshold were "
        "all chosen on the validation split by simulated latency. Simulated ms/token counts the "
        "decode steps only (no prefill, no per-step bookkeeping), so it sits below the measured "
        "figures: it ranks settings, it does not predict wall time.",
        "",
    ]
    measured = report["measured"]
    for title, prefix in (
        ("Measured decode latency (ms/token, the target's prompt prefill left out) and "
         "speedup by category", "decode_"),
        ("Measured latency of the decode steps alone (ms/token, the draft's prompt prefill "
         "left out too) and speedup by category", "steady_"),
        ("Measured end-to-end latency (ms/token, prefill included) and speedup by category", ""),
        ("Priced decode latency (ms/token): each run's own target and draft calls at the "
         "per-forward costs timed while tuning, free of the run's timing noise", "priced_"),
    ):
        if prefix in ("steady_", "priced_") and not _has_figure(measured, prefix):
            continue
        lines += [f"## {title}", ""]
        lines += _measured_table(measured, prefix)
        lines.append("")
    lines += [
        "## DISCO against its baselines (measured)",
        "",
        "Latency change of in-domain DISCO against the best static k and the heuristic tuned "
        "for the same suite (negative = DISCO faster) on decode latency, on the decode steps "
        "alone (steady: every drafting arm pays the same draft prefill, which no length "
        "decision changes), end to end, and priced (each run's own calls at the costs timed "
        "while tuning: what the decisions cost, without the run's timing noise); gap closed "
        "= (static - DISCO) / (static - oracle) "
        "on decode latency for each DISCO artifact (transfer = trained on the other suite). "
        f"The row `overall ({IN_DOMAIN})` runs each suite's prompts with that suite's own "
        "artifact and baselines; `mean of suites` averages the per-suite changes. The plain "
        "`overall` row compares with the first artifact's baselines.",
        "",
        "| scope | baselines from | vs best static: decode | steady | end to end | priced "
        "| vs heuristic: decode | steady | end to end | priced | gap closed |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    scopes = dict(measured)
    if report.get("overall_in_domain"):
        scopes[f"overall ({IN_DOMAIN})"] = report["overall_in_domain"]
    for scope, t in scopes.items():
        gaps = ", ".join(
            f"{k}: {_f(v, '.0%')}" for k, v in t.get("decode_gap_closed", {}).items()
        )
        lines.append(
            f"| {scope} | {t['compare']['home_artifact']} | " + " | ".join(_change_cells(t))
            + f" | {gaps} |"
        )
    mean = report.get("mean_of_suites") or {}
    if any(v is not None for v in mean.values()):
        lines.append(
            "| mean of suites | each suite's own | " + " | ".join(_change_cells(mean)) + " |  |"
        )
    lines += _cost_rule_lines(scopes, mean)
    lines += [
        "",
        "## Classifier F1 (macro over accept / reject) beside the best static length",
        "",
        "A static k seen as a classifier says *keep drafting* before draft position k - 1; "
        "its k is the best-F1 one on validation. Test = the test split of each suite "
        "(transfer when the artifact was trained on the other suite).",
        "",
        "| artifact | rows (train) | tau / SL_max | split | classifier F1 | static k | static F1 |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: |",
    ]
    for label, a in report["artifacts"].items():
        v = a["val_f1"]
        lines.append(
            f"| {label} | {a['train_rows']} | {a['tau']} / {a['sl_max']} | val | "
            f"{_f(v.get('classifier', {}).get('f1_macro'), '.3f')} | {v.get('static_k')} | "
            f"{_f(v.get('static', {}).get('f1_macro'), '.3f')} |"
        )
        for suite, m in a["test_f1"].items():
            kind = "" if suite in (a["train_suites"] or []) else " (transfer)"
            lines.append(
                f"| {label} |  |  | test {suite}{kind} | "
                f"{_f(m.get('classifier', {}).get('f1_macro'), '.3f')} | {m.get('static_k')} | "
                f"{_f(m.get('static', {}).get('f1_macro'), '.3f')} |"
            )
    lines += [
        "",
        "## Simulated on the same test split (ms/token)",
        "",
        "| artifact | test suite | plain | k=1..8 | best static (val) | confidence (val) | "
        "DISCO | oracle | floor |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, a in report["artifacts"].items():
        for suite, sim in a["simulated_test"].items():
            sweep = " / ".join(_f(v["ms_per_token"]) for v in sim["sweep"].values())
            lines.append(
                f"| {label} | {suite} | {_f(sim['ar_ms_per_token'])} | {sweep} | "
                f"{_f(sim['static']['ms_per_token'])} (k={sim['static']['sl_max']}) | "
                f"{_f(sim['confidence']['ms_per_token'])} | {_f(sim['disco']['ms_per_token'])} | "
                f"{_f(sim['oracle']['ms_per_token'])} | "
                f"{_f((sim.get('best_schedule') or {}).get('ms_per_token'))} |"
            )
    cost_sims = [(label, suite, sim["disco-cost"]) for label, a in report["artifacts"].items()
                 for suite, sim in a["simulated_test"].items() if sim.get("disco-cost")]
    if cost_sims:
        lines.append("")
    for label, suite, c in cost_sims:
        lines.append(
            f"- DISCO's cost rule [{label}] on {suite}: {_f(c['ms_per_token'])} ms/token "
            f"(cap {c['sl_max']}, guess {c['guess']})"
        )
    lines += [
        "",
        "Floor = the fastest schedule any length policy could follow (lengths 0..8 chosen "
        "knowing the hits and the costs, `simulate.best_schedule`): the oracle drafts until the "
        "first miss, which over-drafts when a long verification costs more than it gains.",
        "",
        "Costs measured while tuning (ms per forward):",
        "",
    ]
    for label, a in report["artifacts"].items():
        c = a["costs"]
        tgt = ", ".join(f"{n + 1}: {v:.0f}" for n, v in enumerate(c["target_ms"][:9]))
        source = c.get("source", "measured")
        lines.append(
            f"- {label}: draft {c['draft_ms']:.1f}; target by tokens fed {{{tgt}}}; DISCO "
            f"decision {c['decision_ms']:.3f} ms"
            + ("" if source == "measured" else f" (from the cost {source}"
               + (", simulated)" if c.get("simulated") else ")"))
        )
    ex = report["exactness"]
    lines += [
        "",
        "## Exactness",
        "",
        f"{ex.get('checked')} greedy outputs compared with plain decoding: {ex.get('differs')} "
        f"differ ({ex.get('numerical_ties')} numerical ties at top-2 gap <= "
        f"{ex.get('tie_tolerance')}, {ex.get('bugs')} bugs). Per-method details: bench/summary.md.",
    ]
    return "\n".join(lines) + "\n"
