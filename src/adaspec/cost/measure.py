"""Measure a cost profile: a calibration of well under 30 s on a CPU.

For each context length, the cache is filled once (which times the prompt prefill), then
every size n is timed as one forward of n tokens followed by a rollback to the context, in
rounds that interleave the sizes (a burst of other work on the machine then lands on one
round of every size, not on every round of one); the median of the rounds after a warm-up
round is kept. The loop's own per-step overhead comes from `engine/overhead.py`, handed in.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from adaspec.backends.base import ModelBackend
from adaspec.cost.profile import CostProfile, Curve

TARGET_SIZES = [1, 2, 3, 4, 5, 6, 8, 12, 16]
# on a GPU a pass of 64 tokens may cost little more than one: token trees of up to 64 nodes
# (the static runtime's largest graph) are priced from measured points, not extrapolated
GPU_TARGET_SIZES = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
DRAFT_SIZES = [1, 2, 3, 4]
CONTEXTS = [128, 512]
REPEATS = 3
BUDGET_S = 25.0  # the calibration a user waits for once per configuration
OVERHEAD_TOKENS = 16
# (target, tokenizer, tokens) -> ms the loop adds per step (engine.overhead.loop_overhead_ms)
LoopOverhead = Callable[[ModelBackend, Any, int], float]


def context_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """Ordinary-looking token ids (the cost does not depend on which tokens)."""
    rng = random.Random(seed)
    hi = max(2, min(vocab, 30000))
    return [rng.randrange(1, hi) for _ in range(n)]


def _time_curve(
    backend: ModelBackend,
    sizes: list[int],
    contexts: list[int],
    repeats: int,
    tick: Callable[[], None],
) -> tuple[Curve, float]:
    """The backend's forward ms per size and context; its prefill tokens/s (longest context)."""
    ms: list[list[float]] = []
    prefill_rate = 0.0
    for context_len in contexts:
        ids = context_ids(context_len, backend.vocab_size)
        t0 = time.perf_counter()
        backend.prefill(torch.tensor(ids))
        backend.synchronize()  # a GPU's pass is timed done, not queued
        prefill_rate = context_len / (time.perf_counter() - t0)
        tick()
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for round_ in range(repeats + 1):  # round 0 warms up
            for n in sizes:
                tokens = torch.tensor(ids[-n:] if n <= len(ids) else ids[-1:] * n)
                t0 = time.perf_counter()
                backend.forward(tokens)
                backend.synchronize()
                elapsed = 1000 * (time.perf_counter() - t0)
                backend.truncate(context_len)
                if round_:
                    times[n].append(elapsed)
                tick()
        ms.append([statistics.median(times[n]) for n in sizes])
    backend.reset()
    return Curve(list(sizes), list(contexts), ms), prefill_rate


def copy_bandwidth_gbs(megabytes: int = 256, repeats: int = 3, device: str = "cpu") -> float:
    """GB/s (bytes read + written) of a large float32 copy in `device`'s memory (a GPU's
    own for `cuda`), best of `repeats`: what a pass's weight reads are held against."""
    src = torch.ones(megabytes * (1 << 20) // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def _probe(backend: ModelBackend) -> tuple[float, float, float]:
    """Rough costs to plan the calibration: ms of a 1-token and an 8-token forward, and
    prefill ms per token."""
    ids = context_ids(32, backend.vocab_size, seed=2)
    t0 = time.perf_counter()
    backend.prefill(torch.tensor(ids))
    backend.synchronize()
    per_token = 1000 * (time.perf_counter() - t0) / len(ids)
    times = []
    for n in (1, 8):
        t0 = time.perf_counter()
        backend.forward(torch.tensor(ids[:n]))
        backend.synchronize()
        times.append(1000 * (time.perf_counter() - t0))
        backend.truncate(len(ids))
    backend.reset()
    return times[0], times[1], per_token


def plan_within_budget(
    probes: list[tuple[float, float, float, list[int]]],
    contexts: list[int],
    repeats: int,
    budget_s: float = BUDGET_S,
) -> tuple[list[list[int]], list[int], int]:
    """Shrink the calibration until its estimated time fits the budget: fewer rounds, then
    fewer sizes, then one context. probes: (ms for 1 token, ms for 8, prefill ms per token,
    sizes) per model. Returns (sizes per model, contexts, repeats)."""

    def estimate(all_sizes: list[list[int]], ctxs: list[int], reps: int) -> float:
        total = 0.0
        for (one, eight, prefill, _), sizes in zip(probes, all_sizes, strict=True):
            slope = max(0.0, (eight - one) / 7)
            per_round = sum(one + slope * (n - 1) for n in sizes)
            total += sum(prefill * c for c in ctxs) + len(ctxs) * (reps + 1) * per_round
        return total / 1000

    all_sizes = [list(p[3]) for p in probes]
    steps = [
        lambda a, c, r: (a, c, max(1, r - 1)),
        lambda a, c, r: ([[n for n in s if n in (1, 2, 3, 4, 6, 8)] or s for s in a], c, r),
        lambda a, c, r: (a, c[:1], r),
        lambda a, c, r: (a, c, 1),
        lambda a, c, r: ([[n for n in s if n in (1, 2, 4)] or s for s in a], c, r),
    ]
    plan = (all_sizes, list(contexts), repeats)
    for shrink in steps:
        if estimate(*plan) <= budget_s:
            break
        plan = shrink(*plan)
    return plan


@torch.inference_mode()
def measure_profile(
    target: ModelBackend,
    draft: ModelBackend | None = None,
    tokenizer=None,
    key: dict | None = None,
    sizes: list[int] | None = None,
    draft_sizes: list[int] | None = None,
    contexts: list[int] | None = None,
    repeats: int = REPEATS,
    progress: bool | None = None,
    *,
    loop_overhead: LoopOverhead,
) -> CostProfile:
    """Time the target (and draft) on this machine; a progress bar on stderr when it is a
    terminal (or when `progress` is True). `loop_overhead`: what the decoding loop adds per
    step over the same backend (`engine.overhead.loop_overhead_ms`; the loop sits above this
    layer, so its caller hands it in)."""
    from tqdm import tqdm

    sizes = sizes or (GPU_TARGET_SIZES if getattr(target, "device", "cpu") == "cuda"
                      else TARGET_SIZES)
    draft_sizes = draft_sizes or DRAFT_SIZES
    max_len = target.max_context - max(sizes) - OVERHEAD_TOKENS - 2
    if draft is not None:
        max_len = min(max_len, draft.max_context - max(draft_sizes) - 2)
    contexts = [c for c in (contexts or CONTEXTS) if c <= max_len] or [max(8, max_len)]
    # A slow machine or runtime (torch bf16 on a CPU without bf16 units) gets a coarser
    # calibration rather than a long wait.
    probes = [(*_probe(target), sizes)]
    if draft is not None:
        probes.append((*_probe(draft), draft_sizes))
    planned, contexts, repeats = plan_within_budget(probes, contexts, repeats)
    sizes = planned[0]
    if draft is not None:
        draft_sizes = planned[1]
    steps = len(contexts) * (1 + (repeats + 1) * len(sizes)) + OVERHEAD_TOKENS
    if draft is not None:
        steps += len(contexts) * (1 + (repeats + 1) * len(draft_sizes))
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=steps, desc="measuring costs", unit="fwd", disable=not show,
               file=sys.stderr, leave=False)
    started = time.perf_counter()
    try:
        target_curve, prefill_rate = _time_curve(target, sizes, contexts, repeats, bar.update)
        draft_curve, draft_rate = None, 0.0
        if draft is not None:
            draft_curve, draft_rate = _time_curve(draft, draft_sizes, contexts, repeats,
                                                  bar.update)
        overhead = loop_overhead(target, tokenizer, OVERHEAD_TOKENS)
        bar.update(OVERHEAD_TOKENS)
    finally:
        bar.close()
    device = getattr(target, "device", "cpu")  # the floor of a GPU runtime is its memory's
    bandwidth = copy_bandwidth_gbs(1024 if device != "cpu" else 256, device=device)
    return CostProfile(
        target=target_curve,
        draft=draft_curve,
        prefill_tokens_per_s=prefill_rate,
        draft_prefill_tokens_per_s=draft_rate,
        overhead_ms=overhead,
        bandwidth_gbs=bandwidth,
        key=dict(key or {}),
        source="measured",
        notes=f"calibration took {time.perf_counter() - started:.1f} s; medians of {repeats} "
              "rounds after a warm-up round",
    )
