"""Greedy answers decoded together (issue 33): does a request's answer depend on its
companions, its arrival order or the method, and how close are the top two tokens where it
does?

Loads the pair as `adaspec serve --max-batch N` does and runs waves of N chat requests
(prompts as `concurrency_sweep.py` picks them, 128 tokens, greedy) through the batch decoder:
`ar` in arrival order (the reference), then other methods and `ar` in reverse order. For
every answer that parts from the reference it scores the reference's prefix up to the first
differing token on one slot alone and reports the target's top-2 logit gap there: a gap
below the runtime's tie tolerance (0.5 logits for the llama.cpp runtimes) is a numerical
near-tie, where kernels that sum in another order may pick either token.

    .venv/bin/python experiments/batch_greedy.py --requests 8 \
        --out experiments/results/batch-greedy-epyc
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from batch_inprocess import reset_slots, run_requests  # noqa: E402
from concurrency_sweep import prompt_pool  # noqa: E402

from adaspec.cost.batch import batch_cost_for  # noqa: E402
from adaspec.engine.batch import BatchDecoder  # noqa: E402
from adaspec.engine.steps import GenerationResult  # noqa: E402
from adaspec.lab.bench.machine import describe_machine  # noqa: E402
from adaspec.serve.config import ServeConfig  # noqa: E402
from adaspec.serve.instance import ModelInstance  # noqa: E402


def top2_gap(instance: ModelInstance, ids: list[int]) -> float:
    """The target's top-2 logit gap after `ids`, scored on slot 0 alone."""
    reset_slots(instance)
    row = instance.slots[0][0].forward(torch.tensor(ids)).logits[-1].float()
    top = torch.topk(row, 2).values
    return float(top[0] - top[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--methods", default="ngram:k=4,auto", help="compared with batched ar")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--suites", default="humaneval,codeedit,wmt,sharegpt")
    ap.add_argument("--out", default="experiments/results/batch-greedy")
    args = ap.parse_args()
    n = args.requests
    instance = ModelInstance.load(ServeConfig(method="auto", max_batch=n, history="off"))
    instance.open_slots(n)
    cost = batch_cost_for(instance.target, [v for v, _ in instance.slots]).ms
    prompts = [p.text for p in prompt_pool(args.suites.split(","), n, 2000)]
    forward, reverse = list(range(n)), list(reversed(range(n)))
    def wave(method: str, order: list[int]) -> dict[int, GenerationResult]:
        return run_requests(instance, BatchDecoder(cost=cost), method, prompts,
                            args.max_tokens, order)[0]

    ref = wave("ar", forward)
    runs = [(m, forward) for m in args.methods.split(",")] + [("ar", reverse)]
    rows = []
    for method, order in runs:
        got = wave(method, order)
        parted = []
        for i in range(n):
            a, b = ref[i].token_ids, got[i].token_ids
            if a == b:
                continue
            j = next((t for t in range(min(len(a), len(b))) if a[t] != b[t]),
                     min(len(a), len(b)))
            parted.append({"request": i, "token": j,
                           "gap": round(top2_gap(instance, ref[i].prompt_ids + a[:j]), 4)})
        rows.append({"method": method, "order": "arrival" if order == forward else "reversed",
                     "same": n - len(parted), "requests": n, "parted": parted})
        print(json.dumps(rows[-1]), flush=True)
    instance.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"machine": describe_machine(), "target_kind": instance.target.kind,
              "command": " ".join(["python", *sys.argv]), "rows": rows}
    (out / "batch_greedy.json").write_text(json.dumps(record, indent=1))
    gaps = [p["gap"] for r in rows for p in r["parted"]]
    lines = [f"# Greedy answers decoded together ({n} requests, {instance.target.kind})", "",
             "Against batched `ar` in arrival order; gap: the target's top-2 logit gap where "
             "the answer parts (scored alone).", "",
             "| method | order | same answer | gaps where answers part |",
             "| --- | --- | ---: | --- |"]
    for r in rows:
        parted = ", ".join(f"{p['gap']:.3f}" for p in r["parted"]) or "-"
        lines.append(f"| `{r['method']}` | {r['order']} | {r['same']} / {r['requests']} | "
                     f"{parted} |")
    lines += ["", f"Largest gap at a parting: {max(gaps):.3f}" if gaps else "No answer parted."]
    (out / "batch_greedy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
