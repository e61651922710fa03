"""Read `adaspec bench` runs of chains and token trees and write the MCSD comparison.

For every method of each run (a results folder with summary.json): the tree's depth, drafted
nodes and budget (root-to-leaf paths), acceptance (accepted / drafted depth per step, so a
tree compares with the chain of its depth), MAT and speedup over `ar`; then the chain of the
same depth beside each tree, the paper's monotonic rule (non-increasing vs non-decreasing
branching of one budget and depth), the best tree with budget <= 32 against the best chain,
the three tree verifiers on one shape, and the Spec-Bench vs HumanEval split of the best two.

    .venv/bin/python experiments/mcsd_summary.py \
        experiments/results/mcsd2/t1 experiments/results/mcsd2/t0 \
        --out experiments/results/mcsd2/summary.md
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from adaspec.core.token_tree import tree_node_count
from adaspec.lab.bench.references import parse_bench_method

BUDGET_LIMIT = 32


@dataclass
class Row:
    method: str
    depth: int
    nodes: int
    budget: int
    factors: tuple[int, ...] | None  # None: a chain from the chain drafter (or ar)
    verifier: str
    acceptance: float | None
    mat: float
    speedup: float
    median_speedup: float
    ms_per_token: float
    by_category: dict[str, float]

    @property
    def is_tree(self) -> bool:
        return self.factors is not None and any(f > 1 for f in self.factors)

    @property
    def shape(self) -> str:
        if self.factors is None:
            return f"chain k={self.depth}" if self.depth else "plain"
        return "x".join(map(str, self.factors))


def load_rows(run: Path) -> list[Row]:
    summary = json.loads((run / "summary.json").read_text())
    temperature = float(summary["config"]["temperature"])
    rows = []
    for method, m in summary["methods"].items():
        spec = parse_bench_method(method)
        factors = spec.tree
        if factors is not None:
            depth, nodes, budget = len(factors), tree_node_count(factors), math.prod(factors)
        elif spec.name == "draft":
            depth = nodes = int(spec["k"])  # type: ignore[call-overload]
            budget = 1
        else:
            depth = nodes = budget = 0
        verify = str(getattr(spec.params, "verify", "default"))
        if verify == "default":
            verify = ("greedy" if temperature == 0 else "mcss-wor") if factors else (
                "greedy" if temperature == 0 else "speculative")
        rows.append(Row(
            method=method, depth=depth, nodes=nodes, budget=budget, factors=factors,
            verifier=verify if depth else "-", acceptance=m["acceptance_rate"],
            mat=m["mean_accepted_tokens"], speedup=m["speedup"],
            median_speedup=m["median_prompt_speedup"], ms_per_token=m["ms_per_token"],
            by_category={c: v[method]["speedup"] for c, v in summary["categories"].items()
                         if method in v},
        ))
    return rows


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def table(rows: list[Row]) -> list[str]:
    out = ["| method | shape | depth | nodes | budget | verifier | acceptance | MAT | "
           "ms/token | speedup | median prompt speedup |",
           "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| `{r.method}` | {r.shape} | {r.depth} | {r.nodes} | {r.budget} | "
                   f"{r.verifier} | {pct(r.acceptance)} | {r.mat:.2f} | {r.ms_per_token:.0f} | "
                   f"{r.speedup:.2f}x | {r.median_speedup:.2f}x |")
    return out


def chains_by_depth(rows: list[Row]) -> dict[int, Row]:
    return {r.depth: r for r in rows if r.factors is None and r.depth}


def versus_chain(rows: list[Row]) -> list[str]:
    chains = chains_by_depth(rows)
    out = ["| tree | chain of its depth | acceptance: tree / chain (diff) | MAT: tree / chain | "
           "speedup: tree / chain |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        c = chains.get(r.depth)
        if not r.is_tree or c is None or r.verifier not in ("mcss-wor", "greedy"):
            continue
        diff = (r.acceptance or 0) - (c.acceptance or 0)
        out.append(f"| `{r.shape}` | k={c.depth} | {pct(r.acceptance)} / {pct(c.acceptance)} "
                   f"({100 * diff:+.1f} pts) | {r.mat:.2f} / {c.mat:.2f} | "
                   f"{r.speedup:.2f}x / {c.speedup:.2f}x |")
    return out


def monotonic(rows: list[Row]) -> list[str]:
    """Pairs of one budget and depth: non-increasing branching vs non-decreasing."""
    trees = [r for r in rows if r.is_tree and r.verifier in ("mcss-wor", "greedy")]
    out = ["| budget, depth | decreasing | increasing | acceptance | MAT | speedup | "
           "decreasing wins |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for dec in trees:
        f = dec.factors or ()
        if list(f) != sorted(f, reverse=True) or list(f) == sorted(f):
            continue
        for inc in trees:
            g = inc.factors or ()
            if (list(g) != sorted(g) or inc.budget != dec.budget or inc.depth != dec.depth
                    or list(g) == sorted(g, reverse=True)):
                continue
            wins = "yes" if dec.speedup > inc.speedup else "no"
            out.append(
                f"| {dec.budget}, {dec.depth} | `{dec.shape}` | `{inc.shape}` | "
                f"{pct(dec.acceptance)} vs {pct(inc.acceptance)} | {dec.mat:.2f} vs "
                f"{inc.mat:.2f} | {dec.speedup:.2f}x vs {inc.speedup:.2f}x | {wins} |")
    return out


def best(rows: list[Row]) -> list[str]:
    chains = [r for r in rows if r.factors is None and r.depth]
    trees = [r for r in rows if r.is_tree and r.budget <= BUDGET_LIMIT]
    if not chains or not trees:
        return []
    bc = max(chains, key=lambda r: r.speedup)
    bt = max(trees, key=lambda r: r.speedup)
    cats = sorted(set(bc.by_category) | set(bt.by_category))
    out = [f"Best chain: `{bc.method}` {bc.speedup:.2f}x (MAT {bc.mat:.2f}, acceptance "
           f"{pct(bc.acceptance)}). Best tree with budget <= {BUDGET_LIMIT}: `{bt.method}` "
           f"{bt.speedup:.2f}x (MAT {bt.mat:.2f}, acceptance {pct(bt.acceptance)}): the tree is "
           f"{'faster' if bt.speedup > bc.speedup else 'not faster'} "
           f"(its ms/token {100 * (bt.ms_per_token / bc.ms_per_token - 1):+.1f}% against the "
           "chain's).", "",
           "| method | " + " | ".join(cats) + " |", "| --- |" + " ---: |" * len(cats)]
    for r in (bc, bt):
        out.append(f"| `{r.method}` | " + " | ".join(
            f"{r.by_category[c]:.2f}x" if c in r.by_category else "-" for c in cats) + " |")
    return out


def verifiers(rows: list[Row]) -> list[str]:
    shapes: dict[str, list[Row]] = {}
    for r in rows:
        if r.is_tree:
            shapes.setdefault(r.shape, []).append(r)
    out = ["| shape | verifier | acceptance | MAT | speedup |",
           "| --- | --- | ---: | ---: | ---: |"]
    for shape, group in shapes.items():
        if len({r.verifier for r in group}) < 2:
            continue
        for r in sorted(group, key=lambda r: r.verifier):
            out.append(f"| `{shape}` | {r.verifier} | {pct(r.acceptance)} | {r.mat:.2f} | "
                       f"{r.speedup:.2f}x |")
    return out


def report(run: Path) -> list[str]:
    rows = load_rows(run)
    summary = json.loads((run / "summary.json").read_text())
    cfg = summary["config"]
    lines = [f"## {run.name}: T={cfg['temperature']}, suites {', '.join(cfg['suites'])}, "
             f"{cfg['max_new_tokens']} new tokens", "", *table(rows), "",
             "### Trees against the chain of the same depth", "", *versus_chain(rows)]
    for title, part in (("Monotonic rule (same budget and depth)", monotonic(rows)),
                        ("Best configurations", best(rows)),
                        ("Tree verifiers on one shape", verifiers(rows))):
        if len(part) > 2:
            lines += ["", f"### {title}", "", *part]
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="adaspec bench results folders")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    lines = ["# MCSD: token trees vs chains (generated by experiments/mcsd_summary.py)", ""]
    for run in args.runs:
        lines += report(run)
    args.out.write_text("\n".join(lines))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
