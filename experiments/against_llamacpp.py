"""Ratios against a llama.cpp peer, from one `adaspec bench` results folder.

The bench's own summary gives speedups over adaspec's plain loop (`ar`) and, when
`llama-server` or `llamacpp` ran (or `--baseline` named a method), a section against that
baseline. This re-reads a results folder, including one written before that section existed,
and prints the same section against any method of the run: per category the end-to-end and
decode tokens/s ratios to the baseline on the same prompts, their geometric mean over
categories, time to first token as a ratio, outputs equal to the baseline's, and the
per-prompt figures (`lab.bench.report.baseline_markdown`). Writes `against-BASELINE.md` into
the folder.

    python experiments/against_llamacpp.py bench-results/NAME [BASELINE]   # default llamacpp
"""

from __future__ import annotations

import sys
from pathlib import Path

from adaspec.lab.bench.report import baseline_markdown, summarize
from adaspec.lab.bench.runner import read_rows

BASE = "llamacpp"


def main(folder: str, base: str = BASE) -> None:
    rows, _ = read_rows(Path(folder) / "results.jsonl")
    methods = list(dict.fromkeys(r["method"] for r in rows))
    if base not in methods:
        sys.exit(f"{base!r} did not run in {folder} (methods: {', '.join(methods)})")
    summary = summarize(rows, methods, baseline=base)
    ties = {m: e["numerical_ties"] for m, e in summary["methods"].items()}
    bugs = {m: e["bugs"] for m, e in summary["methods"].items()}
    lines = [f"# Against `{base}`: {folder}", "", *baseline_markdown(summary)[2:]]
    lines += ["Greedy outputs that differ from adaspec's plain loop (`ar`), ties / bugs: "
              + ", ".join(f"`{m}` {ties[m]} / {bugs[m]}" for m in methods), ""]
    text = "\n".join(lines)
    (Path(folder) / f"against-{base.replace(':', '_')}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python experiments/against_llamacpp.py RESULTS_FOLDER [BASELINE]")
    main(*sys.argv[1:])
