"""The decode loop's own cost per step, with the model taken out: a backend whose forward
returns precomputed logits (the real vocabulary size, 151,936) in microseconds, so what is
timed is the loop (proposal, verification, cache bookkeeping, text assembly, stats).

Run it on two checkouts to compare loops (alternate the runs; it prints one JSON line):

    python experiments/loop_step_cost.py --method ngram --tokens 256 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

try:  # the layout since the redesign, else the one before it
    from adaspec.backends.base import ForwardOutput, ModelBackend
except ImportError:  # pragma: no cover
    from adaspec.models.backend import ForwardOutput, ModelBackend  # type: ignore[no-redef]
try:
    from adaspec.methods.build import build_generator
except ImportError:  # pragma: no cover
    from adaspec.build import build_generator  # type: ignore[no-redef]

VOCAB = 151_936
PERIOD = 37  # the text repeats with this period, so n-gram lookups find matches


class TableBackend(ModelBackend):
    """Greedy next token = (token + 1) % PERIOD: logits rows from a table, no model."""

    name = "table"
    vocab_size = VOCAB
    max_context = 32_768
    num_layers = 1
    hidden_size = 8
    bytes_per_forward = 0

    def __init__(self) -> None:
        self.rows = torch.randn(PERIOD, VOCAB) * 0.1
        for t in range(PERIOD):
            self.rows[t, (t + 1) % PERIOD] = 10.0
        self.len = 0

    @property
    def cache_len(self) -> int:
        return self.len

    def reset(self) -> None:
        self.len = 0

    def forward(self, tokens, positions=None, tree_mask=None, hidden_layer=None):
        ids = tokens.reshape(-1) % PERIOD
        self.len += len(ids)
        return ForwardOutput(self.rows[ids])

    def prefill(self, tokens, hidden_layer=None):
        self.reset()
        return self.forward(tokens)

    def truncate(self, length: int) -> None:
        self.len = min(self.len, length)

    def keep(self, indices) -> None:
        self.len = len(indices)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    target = TableBackend()
    engine = build_generator(args.method, target, None, None, eos_token_ids=[])
    prompt = list(range(PERIOD)) * 2
    times, steps = [], []
    engine.generate(prompt, max_new_tokens=16)  # warm-up
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        res = engine.generate(prompt, max_new_tokens=args.tokens)
        times.append(time.perf_counter() - t0)
        steps.append(res.stats.target_calls)
    best = min(times)
    print(json.dumps({
        "method": args.method, "tokens": args.tokens, "target_calls": steps[0],
        "best_ms": round(1000 * best, 2), "median_ms": round(1000 * statistics.median(times), 2),
        "us_per_step": round(1e6 * best / steps[0], 1),
    }))


if __name__ == "__main__":
    main()
