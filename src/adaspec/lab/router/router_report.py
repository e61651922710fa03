"""`adaspec router report`: the router against every arm, the oracle router, the learning
curve and the alpha sweep, as report.json, report.md and PNG plots.

Inputs: the training collection, a bench run on the test prompts with every arm and the
router methods (router:ARTIFACT[,mode=dynamic]), and the test prompts' states (`adaspec
router features`) for replaying other policies on the measured test runs.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from adaspec.errors import InputError
from adaspec.lab.bench.report import OVERALL
from adaspec.lab.bench.runner import RESULTS, read_rows
from adaspec.lab.router.collection import load_collection, load_data
from adaspec.lab.router.evaluate import (
    MEAN,
    ORACLE,
    alpha_sweep,
    ar_rows,
    learning_curve,
    oracle_choices,
    policy_choices,
    proxy_vs_truth,
    routed_rows,
    speedups,
    timing_noise,
)
from adaspec.lab.router.reward import COSTS
from adaspec.lab.router.train_policy import train_artifact
from adaspec.methods.spec import parse_method
from adaspec.route.artifact import load_artifact
from adaspec.route.policy import TrainConfig
from adaspec.store.atomic import atomic_open, write_json, write_text

if TYPE_CHECKING:
    from adaspec.cost.profile import CostProfile

REPLAYED = "router greedy (replayed)"
# The report's own training settings, when they differ from the artifact's (e.g. --epochs 3
# beside a 300-epoch artifact): that policy, trained on all training prompts, replayed.
RETRAINED = "router greedy (retrained, replayed)"


def label(method: str) -> str:
    """A short, unique name for plots: router:PATH[,opts] -> router:FILE[,opts]."""
    if not method.startswith("router:"):
        return method
    path, _, opts = method[len("router:") :].partition(",")
    return f"router:{Path(path).name}" + (f",{opts}" if opts else "")


def _sizes(n: int) -> list[int]:
    sizes, s = [], 2
    while s < n:
        sizes.append(s)
        s *= 2
    return [*sizes, n]


def _route_counts(rows: list[dict]) -> dict[str, int]:
    return dict(Counter(r for row in rows for r in row.get("route", [])))


def build_report(
    train_dir: str,
    bench_dir: str,
    features_dir: str,
    config: TrainConfig,
    cost: str,
    alpha: float | None,
    alphas: list[float],
    draws: int,
    profile: CostProfile | None = None,
) -> dict:
    train = load_collection(train_dir)
    if profile is not None:  # the profile reward prices the training runs
        train = train.with_profile(profile)
    rows, _ = read_rows(Path(bench_dir) / RESULTS)
    routers = [m for m in dict.fromkeys(r["method"] for r in rows) if m.startswith("router:")]
    if not routers:
        raise InputError(f"{bench_dir} has no router:ARTIFACT rows; bench the router first")
    art = load_artifact(str(parse_method(routers[0])["artifact"]))
    art.check(target=train.target, where=f"router artifact of {routers[0]!r}")
    methods = list(art.arms.values())
    if methods != list(train.methods.values()):
        raise InputError(
            f"the artifact's arms {methods} are not the training data's {list(train.methods)}"
        )
    test = load_data(bench_dir, features_dir, {m: m for m in methods}, train.params, train.target)
    alpha = art.alpha if alpha is None else alpha
    keep = set(test.prompt_ids)
    live = [r for r in rows if r["prompt_id"] in keep and r["method"] in routers]
    replayed = policy_choices(art.policy, test.states)
    table_rows = [
        *ar_rows(test),
        *[test.rows[(p, m)] for p in test.prompt_ids for m in methods if m != "ar"],
        *live,
        *routed_rows(test, oracle_choices(test), ORACLE),
        *routed_rows(test, replayed, REPLAYED),
    ]
    names = [*methods, *routers, ORACLE, REPLAYED]
    retrained = None
    if (config.to_dict(), alpha, cost) != (art.info.get("train"), art.alpha, art.cost):
        retrained = policy_choices(train_artifact(train, alpha, cost, config).policy, test.states)
        table_rows += routed_rows(test, retrained, RETRAINED)
        names.append(RETRAINED)
    table = speedups(table_rows, names)
    best_arm = max(methods, key=lambda m: table[MEAN].get(m) or 0.0)
    exact = {
        m: {
            "checked": sum(1 for r in live if r["method"] == m and r.get("exactness_checked")),
            "ties": sum(
                1 for r in live if r["method"] == m and (r.get("divergence") or {}).get("kind")
                == "tie"
            ),
            "bugs": sum(
                1 for r in live if r["method"] == m and (r.get("divergence") or {}).get("kind")
                == "bug"
            ),
        }
        for m in routers
    }
    return {
        "arms": methods,
        "routers": routers,
        "artifact": {"alpha": art.alpha, "cost": art.cost, "info": art.info},
        "train_prompts": len(train),
        "train_categories": dict(Counter(train.categories)),
        "test_prompts": len(test),
        "test_categories": dict(Counter(test.categories)),
        "speedup": table,
        "best_single_arm": best_arm,
        "routes": {m: _route_counts([r for r in live if r["method"] == m]) for m in routers},
        "oracle_picks": dict(Counter(test.arms[i] for i in oracle_choices(test))),
        "replayed_picks": dict(Counter(test.arms[int(i)] for i in replayed)),
        "retrained_picks": None
        if retrained is None
        else dict(Counter(test.arms[int(i)] for i in retrained)),
        "timing_noise": timing_noise(test, live),
        "exactness": exact,
        "learning_curve": learning_curve(
            train, test, _sizes(len(train)), alpha, cost, config, draws
        ),
        "alpha_sweep": [
            row for c in train.costs for row in alpha_sweep(train, test, alphas, c, config)
        ],
        "proxy_vs_truth": proxy_vs_truth(train, alpha),
        "settings": {"train": config.to_dict(), "cost": cost, "alpha": alpha, "draws": draws,
                     **({"profile": train.profile_source} if profile is not None else {})},
    }


def _x(v) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _pct(v) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def to_markdown(rep: dict) -> str:
    t = rep["speedup"]
    cats = [c for c in t if c not in (OVERALL, MEAN)]
    names = list(t[OVERALL])
    st, art = rep["settings"], rep["artifact"]
    lines = [
        "# Router report",
        "",
        f"Arms: {', '.join(f'`{a}`' for a in rep['arms'])}. Trained on {rep['train_prompts']} "
        f"prompts ({rep['train_categories']}); tested on {rep['test_prompts']} held-out prompts "
        f"({rep['test_categories']}). The live router's artifact: alpha {art['alpha']}, cost "
        f"{art['cost']}, training {art['info'].get('train')}. The learning curve and the alpha "
        f"sweep train with alpha {st['alpha']} (the sweep varies it), cost {st['cost']}, "
        f"training {st['train']}.",
        "",
        "## Speedup over plain decoding by category",
        "",
        "Arms and `router:` rows are live runs of one bench run; the oracle router (fastest "
        "measured arm per prompt, an upper bound that also profits from timing noise) and the "
        "replayed policies reuse the arms' measured runs (picks from the first turn's state).",
        "",
        "| method | " + " | ".join(cats) + " | overall | mean over categories |",
        "| --- |" + " ---: |" * (len(cats) + 2),
    ]
    for m in names:
        cells = [_x(t[c].get(m)) for c in cats] + [_x(t[OVERALL].get(m)), _x(t[MEAN].get(m))]
        lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    best = rep["best_single_arm"]
    lines += ["", f"Best single arm on the mean over categories: `{best}`.", ""]
    for m in [n for n in names if n not in rep["arms"] and n != ORACLE]:
        worst = min(
            ((t[c][m] or 0.0) / (max(t[c][a] or 0.0 for a in rep["arms"]) or 1.0), c)
            for c in cats
            if t[c].get(m) is not None
        )
        slowest = min((t[c][m], c) for c in cats if t[c].get(m) is not None)
        ratio = (t[MEAN].get(m) or 0.0) / (t[MEAN].get(best) or 1.0)
        text = (
            f"- `{m}`: mean over categories {_x(t[MEAN].get(m))} vs best arm "
            f"{_x(t[MEAN].get(best))} ({ratio:.0%} of it); worst category against that "
            f"category's best arm: {worst[1]} at {worst[0]:.0%}; slowest category against plain "
            f"decoding: {slowest[1]} at {_x(slowest[0])}"
        )
        if m in rep["routers"]:
            text += (
                f"; picks (one per turn) {rep['routes'].get(m)}; exactness "
                f"{rep['exactness'][m]}"
            )
        elif m == REPLAYED:
            text += f"; picks {rep['replayed_picks']}"
        else:
            text += f"; picks {rep['retrained_picks']}"
        lines.append(text + ".")
    lines.append(f"- `{ORACLE}`: picks {rep['oracle_picks']}.")
    noise = rep["timing_noise"]
    lines += [
        "",
        "## Timing noise",
        "",
        f"{noise['pairs']} live router runs ran one arm and produced that arm's tokens, i.e. "
        "repeat the arm's own run of the same prompt in the same bench run. Their ms/token "
        "(routing time taken out) over the arm's: median |ratio - 1| "
        f"{_pct(noise['median_abs_deviation'])}, max {_pct(noise['max_abs_deviation'])}.",
        "",
        "| prompt | method | arm | ratio |",
        "| --- | --- | --- | ---: |",
    ]
    for r in noise["ratios"]:
        lines.append(
            f"| {r['prompt_id']} | `{label(r['method'])}` | `{r['arm']}` | {r['ratio']:.3f} |"
        )
    lines += [
        "",
        "## Learning curve (greedy policy, replayed on the test runs)",
        "",
        "Mean over draws of random training subsets (min - max across draws).",
        "",
        "| training prompts | mean over categories | (min - max) | overall | (min - max) | draws |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in rep["learning_curve"]:
        lines.append(
            f"| {p['prompts']} | {_x(p.get('mean_speedup'))} | {_x(p.get('mean_min'))} - "
            f"{_x(p.get('mean_max'))} | {_x(p['speedup'])} | {_x(p['min'])} - {_x(p['max'])} | "
            f"{p['draws']} |"
        )
    lines += [
        "",
        "## Alpha sweep (greedy policy on all training prompts, replayed)",
        "",
        "| cost | alpha | mean over categories | overall | picks |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for s in rep["alpha_sweep"]:
        lines.append(
            f"| {s['cost']} | {s['alpha']} | {_x(s.get('mean_speedup'))} | {_x(s['speedup'])} "
            f"| {s['picks']} |"
        )
    cv = art["info"].get("cv")
    if cv:
        lines += [
            "",
            f"## Alpha of the live router: {cv[0]['folds']}-fold cross-validation on the training "
            "prompts",
            "",
            "| alpha | mean over categories | overall | fastest arm picked | picks |",
            "| ---: | ---: | ---: | ---: | --- |",
        ]
        for r in cv:
            lines.append(
                f"| {r['alpha']} | {_x(r['mean_speedup'])} | {_x(r['speedup'])} | "
                f"{_pct(r['fastest_share'])} | {r['picks']} |"
            )
    pv = rep["proxy_vs_truth"]
    lines += [
        "",
        "## The paper's proxy against measured speed (training data)",
        "",
        f"Mean Rouge-L per arm: {pv['mean_similarity']}. Mean measured speedup per arm: "
        f"{pv['mean_speedup']}. Fastest arm per prompt: {pv['fastest']}. Best arm by the "
        f"parameter-count reward: {pv['params']['best']} (agrees with the fastest on "
        f"{pv['params']['agrees_with_fastest']:.0%} of prompts); by the measured-cost reward: "
        f"{pv['measured']['best']} ({pv['measured']['agrees_with_fastest']:.0%})"
        + (f"; by the cost profile's reward ({st.get('profile')}): {pv['profile']['best']} "
           f"({pv['profile']['agrees_with_fastest']:.0%})." if "profile" in pv else "."),
        "",
    ]
    return "\n".join(lines)


SCOPES = ((MEAN, "mean_"), (OVERALL, ""))  # (speedup table scope, replay key prefix)


def _references(ax, t: dict, scope: str, best: str) -> None:
    ax.axhline(t[scope][best], ls="--", color="gray", label=f"best arm ({best})")
    ax.axhline(t[scope][ORACLE], ls=":", color="green", label="oracle router")
    ax.axhline(1.0, color="black", lw=0.6)


def write_plots(rep: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = rep["speedup"]
    scopes = [c for c in t if c != OVERALL]
    names = list(t[OVERALL])
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(scopes)), 4.5))
    width = 0.8 / len(names)
    for i, m in enumerate(names):
        ys = [t[c].get(m) or 0.0 for c in scopes]
        ax.bar([j + i * width for j in range(len(scopes))], ys, width, label=label(m))
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(scopes))], scopes, rotation=20)
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("Router vs single arms vs oracle, per category")
    ax.legend(fontsize=7, ncol=2)
    files = [_save(fig, out / "speedup_by_category.png")]

    best = rep["best_single_arm"]
    def learning_curve(ax, key: str) -> None:
        lc = [p for p in rep["learning_curve"] if p.get(f"{key}speedup") is not None]
        xs = [p["prompts"] for p in lc]
        ax.plot(xs, [p[f"{key}speedup"] for p in lc], "o-", label="greedy policy (mean of draws)")
        ax.fill_between(
            xs, [p[f"{key}min"] for p in lc], [p[f"{key}max"] for p in lc], alpha=0.2,
            label="min - max over draws",
        )

    def alpha_sweep(ax, key: str) -> None:
        for c in (c for c in COSTS if any(s["cost"] == c for s in rep["alpha_sweep"])):
            pts = [
                s for s in rep["alpha_sweep"]
                if s["cost"] == c and s.get(f"{key}speedup") is not None
            ]
            ax.plot(
                [s["alpha"] for s in pts], [s[f"{key}speedup"] for s in pts], "o-",
                label=f"cost={c}",
            )

    for draw, xlabel, title, name in (
        (learning_curve, "training prompts", "Learning curve", "learning_curve.png"),
        (alpha_sweep, "alpha (weight of Rouge-L similarity)", "Alpha sweep", "alpha_sweep.png"),
    ):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, (scope, key) in zip(axes, SCOPES, strict=True):
            draw(ax, key)
            _references(ax, t, scope, best)
            ax.set_xlabel(xlabel)
            ax.set_title(f"{scope} (test, replayed)")
        axes[0].set_ylabel("speedup over plain decoding")
        axes[0].legend(fontsize=8)
        fig.suptitle(title)
        files.append(_save(fig, out / name))
    return files


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_open(path, "wb") as f:  # a killed run leaves the old plot or the new one
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
    return str(path)


def write_report(
    train_dir: str,
    bench_dir: str,
    features_dir: str,
    out: str,
    config: TrainConfig,
    cost: str,
    alpha: float | None,
    alphas: list[float],
    draws: int,
    profile: CostProfile | None = None,
) -> Path:
    rep = build_report(
        train_dir, bench_dir, features_dir, config, cost, alpha, alphas, draws, profile
    )
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    rep["plots"] = write_plots(rep, folder)
    write_json(folder / "report.json", rep)
    write_text(folder / "report.md", to_markdown(rep))
    return folder
