"""Ratios against llama.cpp's own plain loop, from one `adaspec bench` results folder.

The bench's own summary gives speedups over adaspec's plain loop (`ar`); a CPU user compares
with the tool they have: llama-cpp-python decoding the same GGUF (`llamacpp`). For every method
and category this prints decode speed (tokens after the first, per second of decoding) as a
ratio to `llamacpp`'s on the same prompts, time to first token as a ratio, and the geometric
mean of the decode ratios over categories. Writes `against-llamacpp.md` into the folder.

    python experiments/against_llamacpp.py bench-results/NAME
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

BASE = "llamacpp"


def main(folder: str) -> None:
    path = Path(folder) / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # per (method, category): decode seconds, decode tokens, prefill seconds, turns
    acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    ties = defaultdict(int)
    bugs = defaultdict(int)
    for r in rows:
        turns = max(1, len(r.get("turn_tokens") or [1]))
        for cat in (r["category"], "all"):
            a = acc[(r["method"], cat)]
            a[0] += r["wall_time"] - r["prefill_time"]
            a[1] += r["new_tokens"] - turns
            a[2] += r["prefill_time"]
            a[3] += turns
        div = r.get("divergence")
        if div:
            (ties if div["kind"] == "tie" else bugs)[r["method"]] += 1
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cats = sorted({r["category"] for r in rows}) + ["all"]

    def decode_rate(m: str, c: str) -> float | None:
        a = acc.get((m, c))
        return a[1] / a[0] if a and a[0] > 0 else None

    def ttft(m: str, c: str) -> float | None:
        a = acc.get((m, c))
        return a[2] / a[3] if a and a[3] else None

    lines = [
        f"# Against llama.cpp's own loop (`{BASE}`): {folder}",
        "",
        "Decode speed ratio to `llamacpp` on the same prompts (tokens after the first per "
        "second of decoding; > 1 is faster), per category; then the geometric mean over "
        "categories, time to first token as a ratio (< 1 is faster), and greedy outputs that "
        "differ from adaspec's plain loop (`ar`), classified.",
        "",
        "| method | " + " | ".join(cats) + " | geomean | TTFT ratio | ties / bugs |",
        "| --- | " + " | ".join("---:" for _ in cats) + " | ---: | ---: | --- |",
    ]
    for m in methods:
        cells, logs = [], []
        for c in cats:
            mine, base = decode_rate(m, c), decode_rate(BASE, c)
            if mine is None or base is None:
                cells.append("n/a")
                continue
            ratio = mine / base
            cells.append(f"{ratio:.2f}x")
            if c != "all":
                logs.append(math.log(ratio))
        gm = f"{math.exp(sum(logs) / len(logs)):.2f}x" if logs else "n/a"
        t_m, t_b = ttft(m, "all"), ttft(BASE, "all")
        t = f"{t_m / t_b:.2f}" if t_m and t_b else "n/a"
        lines.append(f"| `{m}` | " + " | ".join(cells) + f" | {gm} | {t} | {ties[m]} / {bugs[m]} |")
    lines += ["", "Decode ms/token (all prompts): " + ", ".join(
        f"`{m}` {1000 / decode_rate(m, 'all'):.1f}" for m in methods if decode_rate(m, "all"))]
    text = "\n".join(lines) + "\n"
    (Path(folder) / "against-llamacpp.md").write_text(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python experiments/against_llamacpp.py RESULTS_FOLDER")
    main(sys.argv[1])
