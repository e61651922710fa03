"""Loop overhead: the share of wall time spent outside model forward passes.

Every backend's `forward` is wrapped with a timer; for each method the script runs the same
prompts and reports wall time, time inside forwards (target and draft) and the rest, which is
the decode loop's own cost (drafting logic, verification, sampling, cache bookkeeping, text).
Writes overhead.json and overhead.md to --out.

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/fastcpu_overhead.py \
        --weights int8-dyn --draft-weights int4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from adaspec.backends.load import load_backends
from adaspec.core.sampling import SamplingParams
from adaspec.lab.bench.suites import load_suite
from adaspec.methods.build import build_generator
from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT


class ForwardTimer:
    """Wraps backend.forward and adds up the seconds spent inside it."""

    def __init__(self, backend) -> None:
        self.seconds = 0.0
        self.calls = 0
        inner = backend.forward

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        backend.forward = timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="ar;ngram;draft:k=4")
    ap.add_argument("--suite", default="humaneval:2,spec-bench:2")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--weights", default="none")
    ap.add_argument("--draft-weights", default="none")
    ap.add_argument("--out", default="experiments/results/fastcpu")
    args = ap.parse_args()
    torch.set_num_threads(2)
    target, tok, draft, eos = load_backends(
        TARGET_DEFAULT, DRAFT_DEFAULT, "bfloat16", args.weights, args.draft_weights
    )
    timers = {"target": ForwardTimer(target), "draft": ForwardTimer(draft)}
    prompts = []
    for item in args.suite.split(","):
        name, _, limit = item.partition(":")
        prompts += load_suite(name, int(limit) if limit else None)
    methods = args.methods.split(";")
    engines = {m: build_generator(m, target, tok, draft, eos) for m in methods}
    engines[methods[0]].generate(engines[methods[0]].encode_prompt(prompts[0].text), 8)  # warm
    totals = {m: {"wall": 0.0, "target": 0.0, "draft": 0.0, "tokens": 0} for m in methods}
    for p in prompts:
        for m in methods:  # alternate methods prompt by prompt
            ids = engines[m].encode_prompt(p.text)
            for t in timers.values():
                t.reset()
            res = engines[m].generate(ids, args.max_new_tokens, SamplingParams())
            tot = totals[m]
            tot["wall"] += res.stats.wall_time
            tot["tokens"] += res.stats.new_tokens
            tot["target"] += timers["target"].seconds
            tot["draft"] += timers["draft"].seconds
    rows = []
    for m, t in totals.items():
        other = t["wall"] - t["target"] - t["draft"]
        rows.append({"method": m, **{k: round(v, 3) for k, v in t.items()},
                     "overhead_s": round(other, 3),
                     "overhead_share": round(other / t["wall"], 4),
                     "ms_per_token": round(1000 * t["wall"] / t["tokens"], 1)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{args.weights}-{args.draft_weights}"
    meta = {"weights": args.weights, "draft_weights": args.draft_weights, "suite": args.suite,
            "max_new_tokens": args.max_new_tokens, "prompts": [p.id for p in prompts]}
    (out / f"overhead-{tag}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    lines = [f"# Loop overhead (target {args.weights}, draft {args.draft_weights}; "
             f"{len(prompts)} prompts x {args.max_new_tokens} tokens, greedy)", "",
             "| method | ms/token | wall s | target forwards s | draft forwards s | "
             "outside forwards s | overhead share |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['ms_per_token']} | {r['wall']} | {r['target']} | "
                     f"{r['draft']} | {r['overhead_s']} | {100 * r['overhead_share']:.1f}% |")
    (out / f"overhead-{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
