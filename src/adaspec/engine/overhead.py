"""What adaspec's decoding loop costs per step beyond the model itself: the plain loop's time
per token minus the bare loop's (a single-token forward and an argmax per token) over the same
backend. Part of a cost profile (`cost/measure.py` takes it as `loop_overhead`)."""

from __future__ import annotations

import statistics
import time

import torch

from adaspec.backends.base import ModelBackend
from adaspec.core.sampling import argmax
from adaspec.cost import measure
from adaspec.engine.loop import Engine


def _raw_decode_ms(target: ModelBackend, prompt: list[int], tokens: int) -> float:
    """Per-token time of the bare loop: one single-token forward and an argmax per token."""
    token = int(argmax(target.prefill(torch.tensor(prompt)).logits[-1]))
    t0 = time.perf_counter()
    for _ in range(tokens):
        token = int(argmax(target.forward(torch.tensor([token])).logits[-1]))
    return 1000 * (time.perf_counter() - t0) / tokens


def loop_overhead_ms(target: ModelBackend, tokenizer, tokens: int) -> float:
    """What adaspec's plain loop costs per step beyond the bare loop over the same backend
    (bookkeeping, text assembly, stop checks): both run alternately, the medians compared."""
    engine = Engine(target, tokenizer, eos_token_ids=[])
    prompt = measure.context_ids(measure.CONTEXTS[0], target.vocab_size, seed=1)
    bare, loop = [], []
    for _ in range(2):
        bare.append(_raw_decode_ms(target, prompt, tokens))
        stats = engine.generate(prompt, max_new_tokens=tokens + 1, chat=False).stats
        loop.append(1000 * (stats.wall_time - stats.prefill_time) / max(1, stats.new_tokens - 1))
    return max(0.0, statistics.median(loop) - statistics.median(bare))
