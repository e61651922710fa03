"""A draft head through the real engine on the default runtime (issue 65): greedy output,
acceptance, tokens per call and time against plain decoding, in process, held-out prompts.

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/head_e2e.py \
        --artifact /tmp/head-study-data/eagle-2048-d2.pt --out experiments/results/head-e2e

The target runs on the fastest runtime (ik_llama.cpp built with the features patch: the
verification pass returns the states the head reads). Prompts: the first human turns of
ShareGPT conversations from file index 12,000 on (never trained on), after the ones the
study held out. Each prompt is decoded plain (`ar`) and with the head (`k` tokens a step),
alternating which goes first; the answers must be equal token for token.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--artifact", required=True)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--skip", type=int, default=24, help="held-out prompts the study used")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", default="3,5")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quant", default="none", help="the head's weights: none, int8, int8-dyn")
    p.add_argument("--out", default="experiments/results/head-e2e")
    args = p.parse_args()

    from adaspec.backends.load import load_backends
    from adaspec.control.static import StaticLength
    from adaspec.engine.loop import Engine
    from adaspec.lab.head import artifact as head_artifact
    from adaspec.lab.head.data import TRAIN_SHAREGPT, sharegpt_pairs
    from adaspec.lab.head.drafter import HeadDrafter
    from adaspec.store.catalog import TARGET_DEFAULT
    from adaspec.store.loading import cache_dir_for

    dtype = getattr(torch, args.dtype)
    target, tokenizer, _, eos = load_backends(draft=None)
    art = head_artifact.load(args.artifact)
    weights = cache_dir_for(TARGET_DEFAULT) / "model.safetensors"
    embed, tokens = head_artifact.target_parts(None, weights, art.token_ids, dtype)
    from adaspec.store.quant import quantize_model

    quantize_model(tokens, args.quant)
    plain = Engine(target, tokenizer, eos_token_ids=eos)
    engines = {}
    for k in [int(x) for x in args.k.split(",")]:
        head = art.head(dtype)
        quantize_model(head, args.quant)
        drafter = HeadDrafter(head, tokens, embed)
        engines[f"head:k={k}"] = Engine(target, tokenizer, drafter=drafter,
                                        controller=StaticLength(k), eos_token_ids=eos)
    examples = list(sharegpt_pairs(TRAIN_SHAREGPT, 10**9))[args.skip : args.skip + args.prompts]
    rows = []
    for i, ex in enumerate(examples):
        order = ["ar", *engines] if i % 2 == 0 else [*engines, "ar"]
        got = {}
        for name in order:
            eng = plain if name == "ar" else engines[name]
            t0 = time.perf_counter()
            r = eng.generate(ex.prompt[:2000], max_new_tokens=args.max_tokens)
            s = r.stats
            got[name] = {"tokens": r.token_ids, "wall": time.perf_counter() - t0,
                         "decode_s": s.wall_time - s.prefill_time, "calls": s.target_calls,
                         "drafted": s.drafted, "accepted": s.accepted,
                         "draft_s": s.draft_time, "draft_calls": s.draft_calls,
                         "target_s": s.target_time, "n": len(r.token_ids)}
        row = {"id": ex.id}
        for name, g in got.items():
            row[name] = {k: v for k, v in g.items() if k != "tokens"}
            row[name]["equal_to_ar"] = g["tokens"] == got["ar"]["tokens"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {"machine": platform.processor() or platform.machine(),
               "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
               "runtime": target.kind, "artifact": args.artifact, "dtype": args.dtype,
               "quant": args.quant,
               "prompts": len(rows), "methods": {}}
    for name in ["ar", *engines]:
        rs = [r[name] for r in rows]
        n = sum(r["n"] for r in rs)
        calls = sum(r["calls"] for r in rs)
        decode = sum(r["decode_s"] for r in rs)
        drafted = sum(r["drafted"] for r in rs)
        m = {"tokens": n, "target_calls": calls, "tokens_per_call": n / max(1, calls),
             "decode_tok_s": n / decode if decode else 0.0,
             "acceptance": sum(r["accepted"] for r in rs) / drafted if drafted else 0.0,
             "equal_to_ar": sum(r["equal_to_ar"] for r in rs),
             "draft_ms_per_token": 1000 * sum(r["draft_s"] for r in rs)
             / max(1, sum(r["draft_calls"] for r in rs)),
             "target_ms_per_call": 1000 * sum(r["target_s"] for r in rs) / max(1, calls)}
        summary["methods"][name] = m
    ar = summary["methods"]["ar"]["decode_tok_s"]
    for m in summary["methods"].values():
        m["decode_vs_ar"] = m["decode_tok_s"] / ar if ar else 0.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({**summary, "rows": rows}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
