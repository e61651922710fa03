"""The S2D table in the paper's Table 2 form, from bench runs, plus the threshold grids.

For each bench run (one target, one temperature): each method's measured speedup over plain
decoding (`ar`) and mean accepted tokens per target call, the exit usage of the S2D rows, and
the same runs priced under the `flat` profile (SIMULATED: a GPU-like machine where verifying
16 tokens costs about one pass). Under `flat` a draft token costs the profile's draft step
scaled by the weight bytes it reads next to the pretrained 0.5B draft's (for an S2D exit: its
layers and its head; the lazy fill's catch-up is left out), so cheaper exits are cheaper
there too. The threshold grids come from `adaspec s2d tune --report` files.

    .venv/bin/python experiments/s2d_table.py --run "1.5B greedy=DIR" --run "0.5B greedy=DIR" \
        --grid "1.5B=tune-1.5b.json" --out experiments/results/s2d-epyc
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# Qwen2.5-0.5B shapes: what one token reads, in parameters (weights only)
HIDDEN, INTER, HEADS, KV, HEAD_DIM = 896, 4864, 14, 2, 64
LAYER = HIDDEN * HEADS * HEAD_DIM * 2 + HIDDEN * KV * HEAD_DIM * 2 + 3 * HIDDEN * INTER
FULL_DRAFT = 24 * LAYER + 151936 * HIDDEN  # the pretrained 0.5B: 24 layers, untied full head


def exit_fraction(layers: int, kept: int, checks: int) -> float:
    return (layers * LAYER + checks * kept * HIDDEN) / FULL_DRAFT


def label(method: str) -> str:
    if method == "ar":
        return "plain decoding (`ar`)"
    m = re.match(r"s2d:([^,@]+)(.*)", method)
    if m:
        name, rest = m.group(1), m.group(2)
        kind = ("SoFT" if "soft" in name else "SFT" if "sft" in name else
                "untrained" if "untrained" in name else name)
        ex = re.search(r"exit=(\d+)", rest)
        if ex:
            return f"{kind} draft, exit {ex.group(1)} only"
        given = rest.strip(",")
        return f"{kind} draft, S2D ({given})" if given else f"{kind} draft, S2D (tuned exits)"
    if method.startswith("draft"):
        return f"pretrained 0.5B draft (`{method}`)"
    return f"`{method}`"


def flat_speedups(rows: list[dict], kept: int) -> dict[str, float]:
    from adaspec.cost.profile import CostProfile

    flat = CostProfile.from_formula("flat")
    ms: dict[str, float] = {}
    tokens: dict[str, int] = {}
    for r in rows:
        if r.get("steps") is None:
            continue
        cost = 0.0
        for d, _ in r["steps"]:
            cost += flat.target_ms(int(d) + 1)
        turns = max(1, len(r.get("turn_tokens") or [1]))
        plain = max(0, int(r["target_calls"]) - turns - len(r["steps"]))
        cost += plain * flat.target_ms(1)
        draft_ms = flat.draft_ms(1)
        if r.get("drafted_by"):
            for part, n in r["drafted_by"].items():
                layers = int(part.split()[-1])
                # the exit checks a token passes: every exit up to its own (tuned methods)
                checks = 1 if "exit=" in r["method"] else 1 + _exits_below(r, layers)
                cost += n * draft_ms * exit_fraction(layers, kept, checks)
        elif r.get("draft_calls"):
            cost += int(r["draft_calls"]) * draft_ms
        m = r["method"]
        ms[m] = ms.get(m, 0.0) + cost
        tokens[m] = tokens.get(m, 0) + max(0, int(r["new_tokens"]) - turns)
    per = {m: ms[m] / tokens[m] for m in ms if tokens[m]}
    return {m: per["ar"] / v for m, v in per.items()} if "ar" in per else {}


def _exits_below(row: dict, layers: int) -> int:
    parts = sorted(int(p.split()[-1]) for p in row.get("drafted_by", {}))
    return sum(1 for p in parts if p < layers)


def run_table(name: str, folder: Path, kept: int) -> list[str]:
    from adaspec.lab.bench.report import summarize

    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()
            if line.strip()]
    summary = summarize(rows)
    flat = flat_speedups(rows, kept)
    ex = summary["exactness"]
    lines = [f"### {name}", "",
             f"`{folder}`: {len({r['prompt_id'] for r in rows})} prompts; exactness: "
             f"{ex['checked']} runs checked, {ex['bugs']} bugs, {ex['numerical_ties']} "
             "numerical ties.", "",
             "| method | speedup | MAT | exit usage (share of drafted tokens) | flat profile "
             "(SIMULATED) |", "| --- | ---: | ---: | --- | ---: |"]
    for m, e in summary["methods"].items():
        by = e.get("drafted_by") or {}
        total = sum(by.values())
        usage = ", ".join(f"{k}: {v / total:.0%}" for k, v in sorted(
            by.items(), key=lambda kv: int(kv[0].split()[-1]))) if total else ""
        sp = e.get("speedup")
        lines.append(f"| {label(m)} | {sp:.2f}x | {e['mean_accepted_tokens']:.2f} | {usage} | "
                     f"{flat.get(m, float('nan')):.2f}x |" if sp else f"| {label(m)} | | | | |")
    return lines + [""]


def plot_grids(grids: dict[str, Path], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(grids), figsize=(5.2 * len(grids), 4.4), squeeze=False)
    lines = []
    for ax, (name, path) in zip(axes[0], grids.items(), strict=True):
        rep = json.loads(Path(path).read_text())
        if len(rep["exits"]) != 3:
            continue
        values = sorted({g["thresholds"][0] for g in rep["grid"]})
        best: dict[tuple[float, float], float] = {}
        for g in rep["grid"]:
            key = tuple(g["thresholds"])
            best[key] = max(best.get(key, 0.0), g["speedup"])
        mat = [[best.get((a, b), float("nan")) for a in values] for b in values]
        im = ax.imshow(mat, origin="lower", cmap="viridis")
        ax.set_xticks(range(len(values)), [f"{v:g}" for v in values], rotation=60)
        ax.set_yticks(range(len(values)), [f"{v:g}" for v in values])
        ax.set_xlabel(f"threshold, exit {rep['exits'][0]}")
        ax.set_ylabel(f"threshold, exit {rep['exits'][1]}")
        ax.set_title(f"{name}: predicted speedup (best k)\nbest {rep['thresholds']}, "
                     f"k={rep['k']}: {rep['predicted_speedup']:.2f}x", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046)
        lines.append(f"- {name}: best thresholds {rep['thresholds']} with k={rep['k']}, "
                     f"predicted {rep['predicted_speedup']:.2f}x; exit share "
                     f"{rep['exit_share']} ({rep['val_rows']} validation rows, profile "
                     f"{rep['profile']})")
    fig.tight_layout()
    fig.savefig(out / "threshold_grid.png", dpi=110)
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run", action="append", default=[], help="NAME=BENCH_FOLDER")
    p.add_argument("--grid", action="append", default=[], help="NAME=TUNE_REPORT.json")
    p.add_argument("--kept-tokens", type=int, default=32768)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# S2D, measured (Table 2 form)", ""]
    for item in args.run:
        name, _, folder = item.rpartition("=")  # names may hold "=" (T=1), paths do not
        lines += run_table(name, Path(folder), args.kept_tokens)
    if args.grid:
        lines += ["### Threshold grids (predicted by the tuner, per target)", "",
                  "![threshold grid](threshold_grid.png)", ""]
        lines += plot_grids(dict(g.rsplit("=", 1) for g in args.grid), out) + [""]
    (out / "table.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
