"""The draft head through the real engine on the default runtime (issue 65), held-out prompts:
greedy output, acceptance, tokens per target call and speed against plain decoding, per
category, in process, methods alternating prompt by prompt.

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/head_e2e.py \
        --methods "ar;head:k=2;head:k=3" --out experiments/results/head-e2e-<machine>

The target runs on the fastest runtime (ik_llama.cpp built with the features patch: the
verification pass returns the states the head reads). Prompts the head never trained on:
Spec-Bench translation questions with even ids, ShareGPT conversations from file index
12,000 on, HumanEval 60 on. Greedy (the default), every method's answer must equal `ar`'s
token for token; with `--temperature T` every method samples (seeded per prompt), and the
run reports acceptance and tokens per call at T (the texts differ by design). Beside its
summary it writes `results.jsonl` in the bench's row shape (every step's drafted and
accepted tokens), so `adaspec bench --replay OUT --profile P --head-ms MS` re-prices the
steps under another machine's costs (a prediction, labelled so). With a `router` method among
the methods (`--with-draft` loads the 0.5B for its `draft:` arm) the summary adds the router
against the best single other method and the per-prompt oracle over them.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def held_out_prompts(per_category: int) -> list[tuple[str, str, str]]:
    """(category, id, text): never in the head's training prompts (DESIGN.md)."""
    from adaspec.lab.bench import suites
    from adaspec.lab.head.data import TRAIN_HUMANEVAL, TRAIN_SHAREGPT, sharegpt_pairs

    out = []
    even = [p for p in suites.spec_bench(None)
            if p.category == "translation" and int(p.id.rsplit("/", 1)[1]) % 2 == 0]
    out += [("translation", p.id, p.text) for p in even[:per_category]]
    chat = []
    for ex in sharegpt_pairs(TRAIN_SHAREGPT, 10**9):
        if len(ex.prompt) <= 2000:
            chat.append(ex)
        if len(chat) >= 40 + per_category:
            break
    out += [("chat", ex.id, ex.prompt) for ex in chat[40:]]  # the study held out the first
    code = suites.humaneval(None)[TRAIN_HUMANEVAL:]
    out += [("code", p.id, p.text) for p in code[:: max(1, len(code) // per_category)]
            ][:per_category]
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--methods", default="ar;head:k=2;head:k=3;auto:use=ngram+history+head",
                   help="method strings, separated by ;")
    p.add_argument("--per-category", type=int, default=6)
    p.add_argument("--categories", default="translation,chat,code")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (seed = --seed + the prompt's index)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--with-draft", action="store_true",
                   help="load the built-in draft model too (for `draft:` methods and the "
                   "router's default arms)")
    p.add_argument("--out", default="experiments/results/head-e2e")
    p.add_argument("--summarize", default="",
                   help="run nothing: write a folder's summary again from its rows.jsonl")
    args = p.parse_args()
    if args.summarize:
        return _summarize_again(Path(args.summarize))

    from adaspec.backends.load import load_backends
    from adaspec.core.sampling import SamplingParams
    from adaspec.methods.build import build_generator

    if args.with_draft:
        target, tokenizer, draft, eos = load_backends()
    else:
        (target, tokenizer, _, eos), draft = load_backends(draft=None), None
    methods = args.methods.split(";")
    engines = {m: build_generator(m, target, tokenizer, draft, eos_token_ids=eos)
               for m in methods}
    wanted = set(args.categories.split(","))
    prompts = [x for x in held_out_prompts(args.per_category) if x[0] in wanted]
    engines["ar"].generate("Warm up.", max_new_tokens=8)
    rows = []
    replayable: list[dict] = []
    for i, (cat, pid, text) in enumerate(prompts):
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        got = {}
        sampling = SamplingParams(temperature=args.temperature, seed=args.seed + i)
        for name in order:
            t0 = time.perf_counter()
            r = engines[name].generate(text, max_new_tokens=args.max_tokens, sampling=sampling)
            s = r.stats
            got[name] = {"tokens": r.token_ids, "wall": time.perf_counter() - t0,
                         "decode_s": s.wall_time - s.prefill_time, "calls": s.target_calls,
                         "drafted": s.drafted, "accepted": s.accepted, "draft_s": s.draft_time,
                         "draft_calls": s.draft_calls + s.head_calls,
                         "target_s": s.target_time, "n": len(r.token_ids),
                         "route": s.route}
            # the bench's row shape, so `adaspec bench --replay` re-prices these steps
            replayable.append({
                "prompt_id": pid, "category": cat, "method": name, "repeat": 0,
                "steps": [[int(d), int(a)] for d, a in s.steps], "nodes": list(s.nodes),
                "target_calls": s.target_calls, "draft_calls": s.draft_calls,
                "head_calls": s.head_calls, "new_tokens": len(r.token_ids),
                "prompt_tokens": s.prompt_tokens, "turn_tokens": [len(r.token_ids)],
                "drafted": s.drafted, "accepted": s.accepted, "wall_time": s.wall_time,
                "prefill_time": s.prefill_time})
        row = {"category": cat, "id": pid}
        for name, g in got.items():
            row[name] = {k: v for k, v in g.items() if k != "tokens"}
            row[name]["equal_to_ar"] = g["tokens"] == got["ar"]["tokens"]
        rows.append(row)
        print(json.dumps({"id": pid, **{m: round(row["ar"]["wall"] / row[m]["wall"], 2)
                                        for m in methods}}), flush=True)
    summary = {"machine": platform.processor() or platform.machine(),
               "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
               "runtime": target.kind, "temperature": args.temperature, "prompts": len(rows)}
    summary.update(_categories(rows, methods))
    learned = {}  # `auto`'s prices learned from its calls (cost/live.py): per row count, the
    for m, e in engines.items():  # ratio of what a call took to the profile's price
        memory = getattr(getattr(e, "drafter", None), "memory", None)
        live = getattr(memory, "call_scale", None)
        if live is not None and live.calls:
            profile = e.drafter.profile.target  # type: ignore[union-attr]
            learned[m] = {"calls": round(live.calls, 1),
                          "scale": [round(live.scale(n), 3) for n in range(1, 9)],
                          "profile_ms_at_256": [round(profile(n, 256), 1) for n in range(1, 9)]}
    summary["learned_prices"] = learned
    summary["router"] = _router_summary(rows, methods)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in replayable))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(_table(summary, methods))
    print(_table(summary, methods))
    return 0


def _categories(rows: list[dict], methods: list[str]) -> dict:
    """Each method's aggregates per category and over all prompts."""
    out: dict = {"categories": {}}
    for cat in sorted({r["category"] for r in rows}):
        mine = [r for r in rows if r["category"] == cat]
        out["categories"][cat] = {m: _aggregate([r[m] for r in mine], [r["ar"] for r in mine])
                                  for m in methods}
    out["all"] = {m: _aggregate([r[m] for r in rows], [r["ar"] for r in rows])
                  for m in methods}
    return out


def _summarize_again(out: Path) -> int:
    """summary.json / summary.md of a finished run written again from its rows.jsonl (the
    run's own facts kept: machine, date, command, runtime, temperature)."""
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()
            if line.strip()]
    summary = json.loads((out / "summary.json").read_text())
    methods = [k for k in rows[0] if k not in ("category", "id")]
    summary.update(_categories(rows, methods))
    summary["router"] = _router_summary(rows, methods)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(_table(summary, methods))
    print(_table(summary, methods))
    return 0


def _router_summary(rows: list[dict], methods: list[str]) -> dict:
    """Each `router` method against the other methods (its possible arms) on these prompts:
    the best single one (geomean of its speed over `ar`'s) and the per-prompt oracle (the
    fastest of them on each prompt); the arms it picked. Empty without a router method."""
    import math

    routers = [m for m in methods if m.startswith("router")]
    arms = [m for m in methods if m not in routers]
    if not routers or not rows:
        return {}

    def geomean(xs: list[float]) -> float:
        return math.exp(sum(map(math.log, xs)) / len(xs))

    speed = {m: [r["ar"]["wall"] / r[m]["wall"] for r in rows] for m in methods}
    best = max(arms, key=lambda m: geomean(speed[m]))
    oracle = [max(speed[m][i] for m in arms) for i in range(len(rows))]
    out = {"best_arm": best, "best_arm_vs_ar": geomean(speed[best]),
           "oracle_vs_ar": geomean(oracle), "routers": {}}
    for m in routers:
        picks: dict[str, int] = {}
        for r in rows:
            picks[str(r[m]["route"])] = picks.get(str(r[m]["route"]), 0) + 1
        out["routers"][m] = {"vs_ar": geomean(speed[m]),
                             "vs_best_arm": geomean(speed[m]) / geomean(speed[best]),
                             "vs_oracle": geomean(speed[m]) / geomean(oracle), "picks": picks}
    return out


def _aggregate(rs: list[dict], ar: list[dict]) -> dict:
    import math

    n = sum(r["n"] for r in rs)
    calls = sum(r["calls"] for r in rs)
    drafted = sum(r["drafted"] for r in rs)
    ratios = [a["wall"] / r["wall"] for r, a in zip(rs, ar, strict=True) if r["wall"]]
    return {"tokens": n, "tokens_per_call": n / max(1, calls),
            "acceptance": sum(r["accepted"] for r in rs) / drafted if drafted else 0.0,
            "equal_to_ar": sum(r["equal_to_ar"] for r in rs), "prompts": len(rs),
            "end_to_end_vs_ar_geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)),
            "min_vs_ar": min(ratios),
            # over all its tokens (at T > 0 each method samples texts of its own lengths, so
            # per-prompt wall ratios swing with them)
            "ms_per_token": 1000 * sum(r["wall"] for r in rs) / max(1, n),
            # None: no model or head call drafted (n-gram and history drafts cost no call)
            "draft_ms_per_call": 1000 * sum(r["draft_s"] for r in rs)
            / sum(r["draft_calls"] for r in rs) if sum(r["draft_calls"] for r in rs) else None,
            "target_ms_per_call": 1000 * sum(r["target_s"] for r in rs) / max(1, calls)}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _table(summary: dict, methods: list[str]) -> str:
    lines = [f"{summary['date']}, {summary['machine']}, runtime {summary['runtime']}, "
             f"temperature {summary.get('temperature', 0.0)}, `{summary['command']}`", "",
             "| category | method | end to end vs `ar` (geomean) | lowest prompt | per token vs "
             "`ar` (all tokens) | tokens per target call | acceptance | draft ms a call | "
             "target ms a call | same text as `ar` |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for cat, by in [*summary["categories"].items(), ("all", summary["all"])]:
        for m in methods:
            a = by[m]
            per_token = by["ar"]["ms_per_token"] / a["ms_per_token"] if a["tokens"] else 0.0
            lines.append(f"| {cat} | `{m}` | {a['end_to_end_vs_ar_geomean']:.2f}x | "
                         f"{a['min_vs_ar']:.2f}x | {per_token:.2f}x | "
                         f"{a['tokens_per_call']:.2f} | "
                         f"{a['acceptance']:.2f} | {_ms(a['draft_ms_per_call'])} | "
                         f"{a['target_ms_per_call']:.1f} | {a['equal_to_ar']}/{a['prompts']} |")
    route = summary.get("router") or {}
    if route:
        lines += ["", f"Best single method: `{route['best_arm']}` "
                  f"{route['best_arm_vs_ar']:.2f}x `ar`; the per-prompt oracle over the "
                  f"non-router methods {route['oracle_vs_ar']:.2f}x.", "",
                  "| router | vs `ar` | vs the best single method | vs the oracle | picks |",
                  "| --- | ---: | ---: | ---: | --- |"]
        for m, r in route["routers"].items():
            picks = ", ".join(f"{k} {v}" for k, v in sorted(r["picks"].items()))
            lines.append(f"| `{m}` | {r['vs_ar']:.2f}x | {r['vs_best_arm']:.3f} | "
                         f"{r['vs_oracle']:.3f} | {picks} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
