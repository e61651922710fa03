"""Re-price recorded bench runs under another cost profile: what each method would give on
other hardware. Every figure this module produces is SIMULATED and says so.

A bench row records, per request, every speculation step's (drafted, accepted), the target
and draft calls and the prompt size. Its decode time under a profile is then: one
verification of d + 1 tokens per drafting step, one single-token pass per plain step, one
draft forward per draft call, a draft head step per head call at the `head_ms` given (the
profile has no head), the loop overhead per step, at the request's mean context
length; the prompt prefills are priced at the profile's prefill throughput. What the replay
cannot change is the decisions: a method that adapts to costs (`auto`, DISCO with costs)
would have chosen other steps under other costs, so its re-priced figure is what its
recorded choices would cost there, a lower bound on what it would achieve. Run it with
`auto:profile=FILE` to record the choices it makes under those costs.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from adaspec.cost.profile import CostProfile
from adaspec.errors import InputError
from adaspec.store.atomic import write_text

RESULTS = "results.jsonl"


def _rows(results: Path) -> list[dict]:
    path = results / RESULTS if results.is_dir() else results
    if not path.is_file():
        raise InputError(f"no bench results at {path} (give a results folder or results.jsonl)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise InputError(f"{path}:{n}: not a JSON row (an interrupted write?)") from None
    if not rows:
        raise InputError(f"{path} has no rows")
    return rows


def price_row(row: dict, profile: CostProfile, head_ms: float | None = None) -> dict | None:
    """Decode and prefill ms of one recorded request under `profile`; None when the row
    cannot be re-priced (a reference method whose steps were not recorded, or a method run on
    other weights or another runtime than the run's own, which the profile does not price)."""
    steps = row.get("steps")
    if steps is None or (row.get("drafted", 0) and not steps):
        return None
    if row.get("other_weights") or "@" in row["method"]:
        return None  # another runtime or other weights: not what the profile measured
    turns = max(1, len(row.get("turn_tokens") or [1]))
    new_tokens = int(row["new_tokens"])
    context = row.get("prompt_tokens", 0) / turns + new_tokens / (2 * turns)
    decode = 0.0
    # a tree's call verifies all its nodes (rows recorded before trees: chains, depth = rows)
    nodes = row.get("nodes") or [drafted for drafted, _ in steps]
    for n in nodes:
        decode += profile.target_ms(int(n) + 1, int(context)) + profile.overhead_ms
    plain = max(0, int(row["target_calls"]) - turns - len(steps))
    decode += plain * (profile.target_ms(1, int(context)) + profile.overhead_ms)
    draft_calls = int(row.get("draft_calls", 0))
    prefill = 0.0
    if profile.prefill_tokens_per_s:
        prefill = 1000 * row.get("prompt_tokens", 0) / profile.prefill_tokens_per_s
    if draft_calls:
        if profile.draft is None:
            raise InputError(f"method {row['method']!r} ran a draft model, but the profile has "
                             "no draft costs")
        decode += draft_calls * profile.draft_ms(1, int(context))
        if profile.draft_prefill_tokens_per_s:
            decode += 1000 * row.get("prompt_tokens", 0) / profile.draft_prefill_tokens_per_s
    head_calls = int(row.get("head_calls", 0))
    if head_calls:
        if head_ms is None:
            raise InputError(f"method {row['method']!r} drafted with the draft head: give the "
                             "ms of a head step under this profile (--head-ms)")
        decode += head_calls * head_ms
    return {"decode_ms": decode, "prefill_ms": prefill, "tokens": new_tokens, "turns": turns}


def replay(results: str | Path, profile: CostProfile, name: str,
           head_ms: float | None = None) -> dict:
    """Per method and category: the measured decode ms/token, and the simulated one and
    speedup over plain decoding (`ar`) under `profile`."""
    rows = _rows(Path(results))
    sums: dict[tuple[str, str], dict[str, float]] = defaultdict(
        lambda: defaultdict(float))
    skipped: set[str] = set()
    for row in rows:
        priced = price_row(row, profile, head_ms)
        if priced is None:
            skipped.add(row["method"])
            continue
        decode_tokens = max(0, priced["tokens"] - priced["turns"])  # first token: prefill
        for cat in (row.get("category", "?"), "all"):
            s = sums[(row["method"], cat)]
            s["sim_ms"] += priced["decode_ms"]
            s["tokens"] += decode_tokens
            s["meas_ms"] += 1000 * (row["wall_time"] - row["prefill_time"])
            s["prompts"] += 1
    table: dict[str, dict[str, dict]] = defaultdict(dict)
    for (method, cat), s in sums.items():
        if not s["tokens"]:
            continue
        table[method][cat] = {
            "measured_decode_ms_per_token": s["meas_ms"] / s["tokens"],
            "simulated_decode_ms_per_token": s["sim_ms"] / s["tokens"],
            "prompts": int(s["prompts"]),
        }
    if "ar" not in table:
        raise InputError("the results have no `ar` rows: the replay needs plain decoding as "
                         "its baseline")
    for per_cat in table.values():
        for cat, cell in per_cat.items():
            base = table["ar"].get(cat)
            if base:
                cell["simulated_speedup"] = (base["simulated_decode_ms_per_token"]
                                             / cell["simulated_decode_ms_per_token"])
                cell["measured_speedup"] = (base["measured_decode_ms_per_token"]
                                            / cell["measured_decode_ms_per_token"])
    return {
        "simulated": True,
        "profile": name,
        "profile_source": profile.source,
        "profile_simulated": profile.simulated,
        "profile_device": (profile.key or {}).get("device"),
        "head_ms": head_ms,
        "results": str(results),
        "skipped_methods": sorted(skipped),
        "methods": dict(table),
    }


def geomean(values: list[float]) -> float:
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def to_markdown(report: dict) -> str:
    methods = report["methods"]
    cats = sorted({c for per in methods.values() for c in per if c != "all"}) + ["all"]
    device = report.get("profile_device")
    title = (f"# SIMULATED: recorded runs re-priced under cost profile `{report['profile']}`"
             if report["profile_simulated"] else
             f"# PREDICTED from the measured cost profile `{report['profile']}`"
             + (f" ({device})" if device else "") + ": recorded runs re-priced, not run there")
    lines = [
        title,
        "",
        f"Results: `{report['results']}`. Profile source: {report['profile_source']}"
        + (" (itself simulated, not measured)" if report["profile_simulated"] else "") + "."
        + (f" A draft head step priced at {report['head_ms']} ms (given)."
           if report.get("head_ms") else ""),
        "Each cell: simulated decode speedup over plain decoding (`ar`) under that profile; "
        "in brackets, the speedup measured in the run itself. The recorded steps are kept: a "
        "cost-aware method would have chosen other steps under other costs.",
        "",
        "| method | " + " | ".join(cats) + " | geomean over categories |",
        "| --- | " + " | ".join("---:" for _ in cats) + " | ---: |",
    ]
    for method, per in methods.items():
        cells = []
        for c in cats:
            cell = per.get(c)
            cells.append("n/a" if cell is None or "simulated_speedup" not in cell else
                         f"{cell['simulated_speedup']:.2f}x ({cell['measured_speedup']:.2f}x)")
        gm = geomean([per[c]["simulated_speedup"] for c in cats
                      if c != "all" and c in per and "simulated_speedup" in per[c]])
        lines.append(f"| `{method}` | " + " | ".join(cells) + f" | {gm:.2f}x |")
    if report["skipped_methods"]:
        lines += ["", "Not re-priced (no per-step records, or other weights / runtime): "
                  + ", ".join(f"`{m}`" for m in report["skipped_methods"])]
    return "\n".join(lines) + "\n"


def write_replay(results: str | Path, profile: CostProfile, name: str,
                 head_ms: float | None = None) -> tuple[Path, str]:
    """Write `replay-<name>.json` and `.md` beside the results; (md path, markdown)."""
    report = replay(results, profile, name, head_ms)
    folder = Path(results)
    folder = folder if folder.is_dir() else folder.parent
    slug = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
    md = to_markdown(report)
    for suffix, text in ((".json", json.dumps(report, indent=1) + "\n"), (".md", md)):
        write_text(folder / f"replay-{slug}{suffix}", text)
    return folder / f"replay-{slug}.md", md
