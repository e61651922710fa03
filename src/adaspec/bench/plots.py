"""PNG plots of a benchmark (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from adaspec.bench.report import OVERALL  # noqa: E402
from adaspec.metrics import RequestStats  # noqa: E402


def acceptance_by_position(steps: list[tuple[int, int]]) -> tuple[list[float], list[int]]:
    """Share of steps whose draft token at position i was accepted, given it was drafted
    (`RequestStats.acceptance_by_position`), and how many steps drafted position i."""
    rates = RequestStats(steps=list(steps)).acceptance_by_position()
    counts = [sum(1 for d, _ in steps if d > i) for i in range(len(rates))]
    return rates, counts


def plot_speedup(summary: dict, path: Path) -> bool:
    methods = [m for m in summary["methods"] if m != "ar"]
    cats = [*summary["categories"], OVERALL]
    if not methods:
        return False
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(cats) + 2), 4.2))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        values = []
        for c in cats:
            entry = summary["methods"] if c == OVERALL else summary["categories"][c]
            values.append((entry.get(m) or {}).get("speedup") or 0.0)
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(cats))]
        ax.bar(xs, values, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(cats)), cats, rotation=20, ha="right")
    ax.set_ylabel("speedup over ar (paired ms/token)")
    ax.set_title("Speedup per category")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_acceptance(rows: list[dict], methods: list[str], path: Path) -> bool:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    drawn = False
    for m in methods:
        steps = [tuple(s) for r in rows if r["method"] == m for s in r.get("steps") or []]
        if not steps:
            continue
        rates, counts = acceptance_by_position(steps)  # type: ignore[arg-type]
        keep = [i for i, n in enumerate(counts) if n >= 3] or list(range(len(counts)))
        ax.plot([i + 1 for i in keep], [rates[i] for i in keep], marker="o", label=m)
        drawn = True
    if not drawn:
        plt.close(fig)
        return False
    ax.set_xlabel("draft position (positions drafted in >= 3 steps)")
    ax.set_ylabel("P(accepted | drafted)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance by draft position")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_mat(rows: list[dict], methods: list[str], path: Path) -> bool:
    series: dict[str, list[float]] = {}
    for m in methods:
        if m == "ar":
            continue
        vals = [
            r["new_tokens"] / r["target_calls"]
            for r in rows
            if r["method"] == m and r.get("target_calls")
        ]
        if vals:
            series[m] = vals
    oracle = [
        r["oracle"]["new_tokens"] / r["oracle"]["target_calls"]
        for r in rows
        if r["method"] == "ar" and r.get("oracle") and r["oracle"]["target_calls"]
    ]
    if oracle:
        series["oracle (draft model)"] = oracle
    if not series:
        return False
    top = max(max(v) for v in series.values())
    bins = [1 + 0.25 * i for i in range(int((top - 1) / 0.25) + 2)]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, vals in series.items():
        ax.hist(vals, bins=bins, histtype="step", linewidth=1.6, label=name)
    ax.set_xlabel("MAT per prompt (new tokens / target calls)")
    ax.set_ylabel("prompts")
    ax.set_title("Mean accepted tokens per target call")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_plots(summary: dict, rows: list[dict], out: Path) -> list[str]:
    """Write the PNGs into `out`; returns their file names."""
    methods = list(summary["methods"])
    made = []
    for name, ok in (
        ("speedup_by_category.png", lambda p: plot_speedup(summary, p)),
        ("acceptance_by_position.png", lambda p: plot_acceptance(rows, methods, p)),
        ("mat_histogram.png", lambda p: plot_mat(rows, methods, p)),
    ):
        if ok(Path(out) / name):
            made.append(name)
    return made
