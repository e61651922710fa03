"""Core benchmark: plain decoding vs adaspec drafters vs Hugging Face assisted generation.

One process, the same loaded bf16 models, methods alternating prompt by prompt after a
warm-up; speedups are ratios over plain decoding within this run. Writes rows as they finish
(results.jsonl) and a summary (summary.json, summary.md).

    .venv/bin/python benchmarks/core_humaneval.py --limit 20 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from adaspec.bench.exactness import classify
from adaspec.bench.hf_assisted import hf_generate
from adaspec.bench.suites import humaneval
from adaspec.build import DEFAULT_DRAFT, DEFAULT_TARGET, build_engine, eos_ids_of
from adaspec.models.store import load_model
from adaspec.models.torch_backend import TorchBackend

HF_METHODS = {
    "hf-assisted": {},
    "hf-assisted-constant:k=5": {"num_assistant_tokens": 5, "schedule": "constant"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--methods",
        default="ar,ngram:k=8,draft:k=3,draft:k=5,draft:ctrl=heuristic,hf-assisted,hf-assisted-constant:k=5",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="benchmarks/results/core_humaneval")
    args = ap.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if methods[0] != "ar":
        methods = ["ar", *[m for m in methods if m != "ar"]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    tgt = load_model(DEFAULT_TARGET, dtype=args.dtype)
    drf = load_model(DEFAULT_DRAFT, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    target, draft = TorchBackend(tgt.model, tgt.name), TorchBackend(drf.model, drf.name)
    eos = eos_ids_of(tgt.model, tgt.tokenizer)
    engines = {
        m: build_engine(m, target, tgt.tokenizer, draft, eos)
        for m in methods
        if m not in HF_METHODS
    }

    def run(method: str, prompt_ids: list[int], n: int) -> dict:
        if method in HF_METHODS:
            ids, secs = hf_generate(tgt.model, prompt_ids, n, eos, drf.model, **HF_METHODS[method])
            return {"token_ids": ids, "wall_time": secs, "new_tokens": len(ids)}
        res = engines[method].generate(prompt_ids, max_new_tokens=n)
        return {"token_ids": res.token_ids, **res.stats.to_dict()}

    prompts = humaneval(args.limit)
    encoded = [engines["ar"].encode_prompt(p.text) for p in prompts]
    for m in methods:  # warm-up
        run(m, encoded[0], 8)

    rows: list[dict] = []
    with (
        (out / "results.jsonl").open("w") as f,
        tqdm(total=len(prompts) * len(methods), desc="bench") as bar,
    ):
        for prompt, ids in zip(prompts, encoded, strict=True):
            ref: list[int] | None = None
            for m in methods:
                r = run(m, ids, args.max_new_tokens)
                if m == "ar":
                    ref = r["token_ids"]
                div = (
                    classify(target, ids, ref, r["token_ids"])
                    if ref is not None and m != "ar"
                    else None
                )
                row = {
                    "prompt_id": prompt.id,
                    "method": m,
                    "divergence": None if div is None else div.__dict__,
                    **{k: v for k, v in r.items() if k != "steps"},
                }
                rows.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                bar.update(1)

    summary = summarize(rows, methods)
    summary["machine"] = {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "model_load_s": round(load_s, 1),
    }
    summary["config"] = {
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "suite": "humaneval",
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    md = to_markdown(summary)
    (out / "summary.md").write_text(md)
    print(md)


def summarize(rows: list[dict], methods: list[str]) -> dict:
    by = {m: [r for r in rows if r["method"] == m] for m in methods}
    base_time = sum(r["wall_time"] for r in by["ar"])
    base_tokens = sum(r["new_tokens"] for r in by["ar"])
    result: dict = {"methods": {}}
    for m, rs in by.items():
        tokens = sum(r["new_tokens"] for r in rs)
        wall = sum(r["wall_time"] for r in rs)
        entry = {
            "prompts": len(rs),
            "new_tokens": tokens,
            "tokens_per_s": tokens / wall,
            "ms_per_token": 1000 * wall / tokens,
            # speedup: ratio of ms/token of the paired runs (same prompts, same process)
            "speedup": (base_time / base_tokens) / (wall / tokens),
            "median_prompt_speedup": statistics.median(
                (a["wall_time"] / a["new_tokens"]) / (r["wall_time"] / r["new_tokens"])
                for a, r in zip(by["ar"], rs, strict=True)
            ),
            "differs_from_ar": sum(r["divergence"] is not None for r in rs),
            "numerical_ties": sum(
                1 for r in rs if r["divergence"] and r["divergence"]["kind"] == "tie"
            ),
            "bugs": sum(1 for r in rs if r["divergence"] and r["divergence"]["kind"] == "bug"),
        }
        if "target_calls" in rs[0]:
            drafted = sum(r["drafted"] for r in rs)
            calls = sum(r["target_calls"] for r in rs)
            entry.update(
                target_calls=calls,
                draft_calls=sum(r["draft_calls"] for r in rs),
                mean_accepted_tokens=tokens / calls,
                acceptance_rate=sum(r["accepted"] for r in rs) / drafted if drafted else None,
                time_split={
                    k: sum(r[k] for r in rs) / wall
                    for k in ("prefill_time", "draft_time", "verify_time", "other_time")
                },
            )
        result["methods"][m] = entry
    return result


def to_markdown(summary: dict) -> str:
    lines = [
        "| method | tokens/s | ms/token | speedup vs ar | MAT | acceptance | target calls "
        "| draft calls | draft / verify / other | differs (ties / bugs) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for m, e in summary["methods"].items():
        split = e.get("time_split")
        split_s = (
            f"{split['draft_time']:.0%} / {split['verify_time'] + split['prefill_time']:.0%}"
            f" / {split['other_time']:.0%}"
            if split
            else "n/a"
        )
        acc = e.get("acceptance_rate")
        lines.append(
            f"| `{m}` | {e['tokens_per_s']:.2f} | {e['ms_per_token']:.0f} | {e['speedup']:.2f}x | "
            f"{e.get('mean_accepted_tokens', float('nan')):.2f} | "
            f"{'n/a' if acc is None else f'{acc:.1%}'} | {e.get('target_calls', 'n/a')} | "
            f"{e.get('draft_calls', 'n/a')} | {split_s} | "
            f"{e['differs_from_ar']} ({e['numerical_ties']} / {e['bugs']}) |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
