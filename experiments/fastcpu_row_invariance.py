"""Does verifying a block score what plain decoding scores? Block vs one-at-a-time logits.

For each target quantization and each attention mode (batched SDPA, row-invariant), a real
prompt is prefilled, its greedy continuation of `--block` tokens is scored once as one block
and once one token at a time, and the largest |difference| of the logits and the number of
rows whose argmax differs are reported. Row-invariant attention on a quantized target should
give 0.0 (bit-identical), which is what makes its speculative output equal plain decoding
token for token. Writes row_invariance.json and row_invariance.md to --out.

    .venv/bin/python experiments/fastcpu_row_invariance.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from adaspec.backends.base import ModelBackend
from adaspec.backends.torch.backend import TorchBackend
from adaspec.lab.bench.machine import describe_machine
from adaspec.lab.bench.suites import load_suite
from adaspec.store.catalog import TARGET_DEFAULT
from adaspec.store.model_store import load_model


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def greedy_continuation(backend: ModelBackend, prompt: list[int], n: int) -> list[int]:
    logits = backend.prefill(torch.tensor(prompt)).logits[-1]
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = backend.forward(torch.tensor(out[-1:])).logits[-1]
    return out


def compare(backend: ModelBackend, prompt: list[int], block: list[int]) -> dict:
    backend.prefill(torch.tensor(prompt))
    t0 = time.perf_counter()
    together = backend.forward(torch.tensor(block)).logits.float()
    block_ms = 1000 * (time.perf_counter() - t0)
    backend.truncate(len(prompt))
    t0 = time.perf_counter()
    alone = torch.cat([backend.forward(torch.tensor([t])).logits for t in block]).float()
    single_ms = 1000 * (time.perf_counter() - t0) / len(block)
    diff = (together - alone).abs()
    return {
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "argmax_flips": int((together.argmax(-1) != alone.argmax(-1)).sum()),
        "block_ms": round(block_ms, 1),
        "single_ms": round(single_ms, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=TARGET_DEFAULT)
    ap.add_argument("--quants", default="int8-dyn,int4,int8,none")
    ap.add_argument("--prompts", default="humaneval:2,spec-bench:1",
                    help="bench suites to take prompts from (first turn of each)")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--max-prompt-tokens", type=int, default=0,
                    help="keep only the first N prompt tokens (0: all); a shorter prefill for "
                    "kernels that are slow on many rows (int8-dyn without VNNI)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="experiments/results/fastcpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = []
    for part in args.prompts.split(","):
        name, _, limit = part.partition(":")
        prompts += load_suite(name, int(limit) if limit else None)
    rows = []
    for quant in args.quants.split(","):
        loaded = load_model(args.target, quant=quant)
        ids = [chat_ids(loaded.tokenizer, p.text) for p in prompts]
        if args.max_prompt_tokens:
            ids = [i[: args.max_prompt_tokens] for i in ids]
        for invariant in (False, True):
            backend = TorchBackend(loaded.model, name=loaded.name, row_invariant=invariant)
            for prompt, prompt_ids in zip(prompts, ids, strict=True):
                block = greedy_continuation(backend, prompt_ids, args.block)
                row = {"quant": quant, "attention": "row-invariant" if invariant else "batched",
                       "prompt": prompt.id, **compare(backend, prompt_ids, block)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        del loaded, backend
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": describe_machine(), "target": args.target, "block": args.block,
            "max_prompt_tokens": args.max_prompt_tokens,
            "prompts": args.prompts, "threads": args.threads, "torch": torch.__version__}
    (out / "row_invariance.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"# Block of {args.block} vs one token at a time ({args.target}, prompts {args.prompts}"
        + (f", first {args.max_prompt_tokens} tokens" if args.max_prompt_tokens else "") + ")",
        "",
        "Greedy continuation of each prompt scored as one block and token by token; "
        "max |logit difference| over all rows and prompts, rows whose argmax flips, and the "
        "median forward time of the block and of one single-token step.",
        "",
        "| quant | attention | max abs diff | mean abs diff | argmax flips | block ms | "
        "single ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for quant in args.quants.split(","):
        for attention in ("batched", "row-invariant"):
            group = [r for r in rows if r["quant"] == quant and r["attention"] == attention]
            if not group:
                continue
            block_ms = sorted(r["block_ms"] for r in group)[len(group) // 2]
            single_ms = sorted(r["single_ms"] for r in group)[len(group) // 2]
            lines.append(
                f"| {quant} | {attention} | {max(r['max_abs_diff'] for r in group):.4g} | "
                f"{max(r['mean_abs_diff'] for r in group):.3g} | "
                f"{sum(r['argmax_flips'] for r in group)} / {args.block * len(group)} | "
                f"{block_ms:.0f} | {single_ms:.0f} |"
            )
    (out / "row_invariance.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
