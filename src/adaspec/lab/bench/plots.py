"""PNG plots of a benchmark (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from adaspec.core.metrics import RequestStats  # noqa: E402
from adaspec.lab.bench.report import OVERALL  # noqa: E402
from adaspec.store.atomic import atomic_open  # noqa: E402


def _save(fig, path: Path) -> None:
    """A PNG written atomically (a killed run leaves the old plot or the new one)."""
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)


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
    _save(fig, path)
    plt.close(fig)
    return True


def plot_acceptance(rows: list[dict], methods: list[str], path: Path) -> bool:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    drawn = False
    for m in methods:
        steps = [tuple(s) for r in rows if r["method"] == m for s in r.get("steps") or []]
        if not steps:
            continue
        rates, counts = acceptance_by_position(steps)
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
    _save(fig, path)
    plt.close(fig)
    return True


def tokens_per_call(rows: list[dict]) -> list[int]:
    """Tokens each decode-time target call emitted (accepted + 1), over `rows`; calls that
    verified no draft at all emitted one token."""
    out: list[int] = []
    for r in rows:
        steps = r.get("steps") or []
        out += [a + 1 for _, a in steps]
        out += [1] * max(0, r.get("target_calls", 0) - 1 - len(steps))
    return out


def plot_mat(rows: list[dict], methods: list[str], path: Path) -> bool:
    per_call: dict[str, list[int]] = {}
    per_prompt: dict[str, list[float]] = {}
    for m in methods:
        mine = [r for r in rows if r["method"] == m and r.get("target_calls")]
        if m == "ar" or not mine:
            continue
        per_call[m] = tokens_per_call(mine)
        per_prompt[m] = [r["new_tokens"] / r["target_calls"] for r in mine]
    oracle = [r["oracle"] for r in rows if r["method"] == "ar" and r.get("oracle")]
    if oracle:
        name = "oracle (draft model)"
        per_call[name] = [s + 1 for o in oracle for s in o["steps"]]
        per_prompt[name] = [
            o["new_tokens"] / o["target_calls"] for o in oracle if o["target_calls"]
        ]
    if not any(per_call.values()):
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    top = max(max(v) for v in per_call.values() if v)
    bins = [b + 0.5 for b in range(top + 1)]
    for name, vals in per_call.items():
        if vals:
            left.hist(vals, bins=bins, histtype="step", linewidth=1.6, density=True, label=name)
    left.set_xlabel("tokens per target call (accepted + 1)")
    left.set_ylabel("share of decode calls")
    left.set_title("Tokens per decode-time target call")
    left.legend(fontsize=8)
    top_mat = max(max(v) for v in per_prompt.values() if v)
    bins_p = [1 + 0.25 * i for i in range(int((top_mat - 1) / 0.25) + 2)]
    for name, mats in per_prompt.items():
        right.hist(mats, bins=bins_p, histtype="step", linewidth=1.6, label=name)
    right.set_xlabel("MAT per prompt (new tokens / target calls)")
    right.set_ylabel("prompts")
    right.set_title("MAT per prompt")
    fig.tight_layout()
    _save(fig, path)
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
