"""The results of `adaspec osd simulate`: run.json (small), requests.jsonl (a row per request
and run), summary.md and the rolling-acceptance
plot."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from adaspec.lab.osd.simulate import RunResult
from adaspec.lab.osd.stream import StreamRequest, blocks_of
from adaspec.store.atomic import write_json, write_text

REQUESTS = "requests.jsonl"
WINDOW = 50


def rolling(run: RunResult, window: int = WINDOW) -> list[float]:
    out = []
    for i in range(len(run.requests)):
        part = run.requests[max(0, i - window + 1): i + 1]
        d = sum(r.drafted for r in part)
        out.append(sum(r.accepted for r in part) / d if d else float("nan"))
    return out


def block_end_acceptance(run: RunResult, stream: list[StreamRequest],
                         window: int = WINDOW) -> list[float]:
    """Acceptance over the last `window` requests of each block (fewer if it is shorter)."""
    out = []
    for _, start, end in blocks_of(stream):
        part = run.requests[max(start, end - window): end]
        d = sum(r.drafted for r in part)
        out.append(sum(r.accepted for r in part) / d if d else float("nan"))
    return out


def speed(run: RunResult, k: int, profile) -> float:
    """Decoding speed against plain decoding under a cost profile: every step drafts k
    tokens (draft_ms each) and verifies k + 1 (target_ms(k + 1))."""
    steps = sum(r.steps for r in run.requests)
    tokens = sum(r.accepted for r in run.requests) + steps
    ms = steps * (k * profile.draft_ms(1) + profile.target_ms(k + 1))
    return tokens * profile.target_ms(1) / ms if ms else float("nan")


def precision_recall(guesses: list[list[int]], stream: list[StreamRequest], top: int = 10
                     ) -> dict[int, tuple[float, float, int]]:
    """Per token among the `top` most frequent in the outputs: (precision, recall, count) of
    the draft's greedy guesses (the paper's Table 2)."""
    truth: Counter[int] = Counter()
    guessed: Counter[int] = Counter()
    hit: Counter[int] = Counter()
    for g, r in zip(guesses, stream, strict=True):
        for a, b in zip(g[1:], r.output[1:], strict=True):  # the first token is the prefill's
            truth[b] += 1
            guessed[a] += 1
            if a == b:
                hit[a] += 1
    return {t: (hit[t] / guessed[t] if guessed[t] else float("nan"), hit[t] / n, n)
            for t, n in truth.most_common(top)}


def write_results(out: Path, runs: list[RunResult], stream: list[StreamRequest], setup: dict,
                  profile=None, tokenizer=None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    blocks = blocks_of(stream)
    data: dict[str, Any] = {"setup": setup, "blocks": [{"suite": s, "start": a, "end": b}
                                       for s, a, b in blocks], "runs": []}
    rows = []
    for run in runs:
        data["runs"].append({
            "spec": run.spec, "acceptance": run.acceptance, "seconds": round(run.seconds, 1),
            "block_end_acceptance": block_end_acceptance(run, stream),
            "updates": run.updates,
            "requests": len(run.requests),
        })
        rows += [json.dumps({"spec": run.spec, **r.__dict__}) + "\n" for r in run.requests]
    write_json(out / "run.json", data, indent=1)
    # one row per request and run: a dump the commands regenerate, not a summary to commit
    write_text(out / REQUESTS, "".join(rows))
    write_text(out / "summary.md", summary(runs, stream, setup, profile, tokenizer))
    plot(out / "rolling_acceptance.png", runs, stream)


def _fmt(x: float) -> str:
    return "-" if x != x else f"{x:.3f}"


def summary(runs: list[RunResult], stream: list[StreamRequest], setup: dict, profile=None,
            tokenizer=None) -> str:
    from adaspec.cost.profile import CostProfile

    k = setup["k"]
    blocks = blocks_of(stream)
    frozen = next((r for r in runs if r.spec == "frozen"), None)
    lines = [f"# OSD simulation ({setup['replay']} replay)", ""]
    lines += [f"- {key}: {value}" for key, value in setup.items()]
    lines += ["", f"Acceptance = accepted / drafted tokens (greedy chain of k={k}). Block "
              f"columns: the last {WINDOW} requests of each block; Δ: minus the frozen draft's.",
              ""]
    head = ["run", "acceptance", *[f"{s} [{a}-{b})" for s, a, b in blocks],
            "updates ok/rejected", "update CPU s"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = block_end_acceptance(frozen, stream) if frozen else None
    for run in runs:
        ends = block_end_acceptance(run, stream)
        cells = []
        for i, e in enumerate(ends):
            delta = f" (Δ {e - base[i]:+.3f})" if base is not None and run is not frozen else ""
            cells.append(_fmt(e) + delta)
        ok = sum(u.get("accepted", False) for u in run.updates)
        cpu = sum(u.get("cpu_seconds", 0.0) for u in run.updates)
        lines.append(f"| {run.spec} | {_fmt(run.acceptance)} | " + " | ".join(cells)
                     + f" | {ok}/{len(run.updates) - ok} | {cpu:.0f} |")
    if setup.get("replay") == "engine":
        lines += ["", "## Decoding with the real engine", "",
                  "| run | tokens/s | outputs equal to the target's | numerical ties | bugs "
                  "| updates | update CPU s | update CPU / run wall time |",
                  "|---|---|---|---|---|---|---|---|"]
        for run in runs:
            tokens = sum(r.tokens for r in run.requests)
            secs = sum(r.seconds for r in run.requests)
            exact = sum(bool(r.exact) for r in run.requests)
            kinds = Counter(r.divergence for r in run.requests)
            cpu = sum(u.get("cpu_seconds", 0.0) for u in run.updates)
            lines.append(f"| {run.spec} | {tokens / secs if secs else float('nan'):.2f} | "
                         f"{exact}/{len(run.requests)} | {kinds['tie']} | {kinds['bug']} | "
                         f"{len(run.updates)} | {cpu:.0f} | "
                         f"{cpu / run.seconds if run.seconds else float('nan'):.0%} |")
        lines += ["", "A difference from the stored greedy output is a numerical tie when the "
                  "target's top-2 logits where the two part are within the runtime's kernel "
                  "noise (docs/exactness.md), a bug otherwise."]
        over = setup.get("recording_overhead")
        if over:
            lines += ["", f"Recording (top-{setup['top_k']} where the draft missed): "
                      f"{over['tok_s_without']:.2f} tokens/s without, {over['tok_s_with']:.2f} "
                      f"with, over {over['requests']} requests each, alternating: slowdown "
                      f"{over['slowdown']:+.2%}."]
    lines += ["", "## Speed against plain decoding, from the acceptance", ""]
    profiles = []
    if profile is not None:
        profiles.append(("this machine's cost profile", profile))
    profiles.append(("SIMULATED flat verification curve (`flat`: a GPU-like profile)",
                     CostProfile.from_formula("flat")))
    lines += ["| run | " + " | ".join(n for n, _ in profiles) + " |",
              "|---|" + "---|" * len(profiles)]
    for run in runs:
        lines.append(f"| {run.spec} | "
                     + " | ".join(f"{speed(run, k, p):.2f}x" for _, p in profiles) + " |")
    if frozen is not None and frozen.guesses:  # (the engine replay keeps no guesses)
        last = [r for r in runs if r.spec.startswith("online")][:1]
        if last and last[0].guesses:
            lines += ["", f"## What the draft learned: top-1 precision / recall of the 10 most "
                      f"frequent output tokens, frozen → {last[0].spec} (whole stream)", "",
                      "| token | count | precision | recall |", "|---|---|---|---|"]
            before = precision_recall(frozen.guesses, stream)
            after = precision_recall(last[0].guesses, stream)
            for t, (p0, r0, n) in before.items():
                p1, r1, _ = after[t]
                text = repr(tokenizer.decode([t])) if tokenizer is not None else str(t)
                lines.append(f"| {text} | {n} | {_fmt(p0)} → {_fmt(p1)} | "
                             f"{_fmt(r0)} → {_fmt(r1)} |")
    return "\n".join(lines) + "\n"


def plot(path: Path, runs: list[RunResult], stream: list[StreamRequest]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for run in runs:
        ax.plot(rolling(run), label=run.spec, lw=1.4)
    for suite, start, end in blocks_of(stream):
        ax.axvline(start, color="grey", lw=0.6, ls=":")
        ax.text((start + end) / 2, 0.02, suite, ha="center", transform=ax.get_xaxis_transform(),
                fontsize=8, color="grey")
    ax.set_xlabel("request")
    ax.set_ylabel(f"acceptance (rolling, {WINDOW} requests)")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    from adaspec.store.atomic import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
