"""Which model to extract the sorted draft from: the 0.5B or the 1.5B target's first layers.

For each candidate (source, exits), the untrained extraction is traced teacher-forced on the
target's validation outputs (`adaspec s2d data`), its exits are priced on this machine
(`ExitCosts`, for the chosen weights) and the target's verification by its cost profile; the
tuner's simulator then gives each candidate's best single exit and best thresholds. These
are predictions from the simulator, before any training (training moves acceptance, not
cost); the bench measures the chosen one.

    .venv/bin/python experiments/s2d_extraction.py \
        --data ~/.cache/adaspec/s2d/data/qwen2.5-coder-1.5b-instruct \
        --out experiments/results/s2d-epyc/extraction.md
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

CANDIDATES = [
    ("qwen2.5-coder-0.5b-instruct", (6, 9, 12)),
    ("qwen2.5-coder-0.5b-instruct", (4, 6, 8)),
    ("qwen2.5-coder-0.5b-instruct", (12, 18, 24)),  # up to the whole 0.5B (a reference)
    ("qwen2.5-coder-1.5b-instruct", (2, 4, 6)),
    ("qwen2.5-coder-1.5b-instruct", (4, 6, 8)),
]


def main() -> int:
    import torch

    from adaspec.backends.load import load_backends
    from adaspec.cost.cache import profile_for
    from adaspec.draft import s2d_artifact
    from adaspec.engine.overhead import loop_overhead_ms
    from adaspec.lab.s2d.data import read_meta, read_rows
    from adaspec.lab.s2d.train import kept_token_ids
    from adaspec.lab.s2d.tune import (
        best_single_exit,
        grid_search,
        measure_exit_costs,
        trace_rows,
    )
    from adaspec.store.quant import quantize_model

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--weights", default="int4", choices=("bfloat16", "int8", "int4"))
    p.add_argument("--kept-tokens", type=int, default=32768)
    p.add_argument("--limit", type=int, default=24, help="validation rows")
    args = p.parse_args()

    meta = read_meta(args.data)
    rows = read_rows(args.data)
    val = [r for r in rows if r.split == "val" and r.output][: args.limit]
    target, _, _, _ = load_backends(meta["target"], None, "bfloat16", "fastest", "none")
    profile = profile_for(target, None, loop_overhead=loop_overhead_ms)
    results = []
    for source, exits in CANDIDATES:
        vocab = 151936
        model, _ = s2d_artifact.extract(source, exits, kept_token_ids(rows, args.kept_tokens,
                                                                      vocab), torch.bfloat16)
        model.eval()
        traces = trace_rows(model, val)
        if args.weights != "bfloat16":
            quantize_model(model, args.weights)
        costs = measure_exit_costs(model)
        grid = grid_search(traces, exits, costs, profile.target_ms, [1, 2, 3, 4],
                           [0.0, 0.3, 0.5, 0.7, 0.9, 1.01])
        best = max(grid, key=lambda r: r.tokens / r.ms)
        singles = {}
        for i, e in enumerate(exits):
            r = best_single_exit(traces, exits, i, costs, profile.target_ms, (1, 2, 3, 4))
            hit = float(torch.cat([t.hits[exits.index(e)] for t in traces]).float().mean())
            singles[e] = {"k": r.k, "speedup": round(r.speedup, 3),
                          "mean_accepted": round(r.mean_accepted, 3), "top1_match": round(hit, 3),
                          "token_ms": round(costs.feed_ms(e, 1), 2)}
        results.append({"source": source, "exits": list(exits), "costs": costs.__dict__,
                        "best": {"thresholds": list(best.thresholds), "k": best.k,
                                 "speedup": round(best.speedup, 3)},
                        "single": singles})
        print(json.dumps(results[-1]), flush=True)
        del model
    lines = [
        "# Which model to extract the sorted draft from (untrained, predicted)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; target {meta['target']} "
        f"({target.kind}, its cost profile prices verification); the drafts' exits priced "
        f"on this machine with {args.weights} weights and a {args.kept_tokens}-token head; "
        f"{len(val)} validation rows. Predictions of the tuner's simulator, not bench "
        "measurements.",
        "",
        "| source | exit (layers) | ms per draft token | top-1 = target | best k | predicted "
        "speedup | MAT |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        for e, s in r["single"].items():
            lines.append(f"| {r['source']} | {e} | {s['token_ms']} | {s['top1_match']:.3f} | "
                         f"{s['k']} | {s['speedup']:.2f}x | {s['mean_accepted']:.2f} |")
        b = r["best"]
        lines.append(f"| {r['source']} | exits {r['exits']}, thresholds {b['thresholds']} | | | "
                     f"{b['k']} | {b['speedup']:.2f}x | |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
