"""Per-target exit thresholds for a sorted draft: a grid priced with this machine's costs.

For the validation rows of a target's greedy outputs, one teacher-forced pass gives every
exit's top token and confidence at every position. A greedy chain of k tokens is then
simulated for each threshold setting: which exit answers each token, how many drafted tokens
the target accepts, and what the step costs: the draft's layers and exit checks (lazy fill
included, priced by `ExitCosts` measured here) plus one verification of k + 1 tokens from the
target's cost profile. The setting with the most tokens per ms wins and is stored in the
artifact under the target's name. Figures are predictions (labelled so); the bench measures.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from adaspec.draft.sorted_model import ExitState, SortedDraftLM
from adaspec.errors import InputError

# threshold values per exit: 0 always exits there, 1.01 never does
DEFAULT_GRID = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.01)


@dataclass
class ExitCosts:
    """ms of one decoder layer for one token, one exit check (norm, head, softmax), and the
    per-call rest (embedding, Python), measured on this machine."""

    layer_ms: float
    head_ms: float
    call_ms: float

    def feed_ms(self, layer_tokens: int, checks: int) -> float:
        return layer_tokens * self.layer_ms + checks * self.head_ms + self.call_ms


def _time(fn, reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return 1000 * statistics.median(samples)


@torch.inference_mode()
def measure_exit_costs(model: SortedDraftLM, context: int = 128, reps: int = 24) -> ExitCosts:
    """Single-token feeds through the smallest and the largest exit alone (the slope is a
    layer's cost), and the head with its softmax on one row."""
    exits = model.config.exits
    per = {}
    for e in sorted({exits[0], exits[-1]}):
        state = ExitState(model, (e,))
        state.feed(list(range(100, 100 + context)), ())
        n = state.total

        def one(state=state, n=n) -> None:
            state.feed([7], ())
            state.truncate(n)

        per[e] = _time(one, reps)
    hidden = torch.randn(model.config.hidden_size, dtype=next(model.parameters()).dtype)
    head = _time(lambda: torch.softmax(model.head_logits(hidden).float(), -1).max(), reps)
    lo, hi = exits[0], exits[-1]
    layer = (per[hi] - per[lo]) / (hi - lo) if hi > lo else (per[lo] - head) / lo
    layer = max(layer, 1e-3)
    call = max(per[lo] - lo * layer - head, 0.0)
    return ExitCosts(layer, head, call)


@dataclass
class ExitTrace:
    """One validation row: per exit, whether its top token is the target's, and its
    confidence, at each output position."""

    context: int  # prompt length
    hits: torch.Tensor  # [exits, n] bool
    conf: torch.Tensor  # [exits, n] float


@torch.inference_mode()
def trace_rows(model: SortedDraftLM, rows, limit: int | None = None, progress: bool = True
               ) -> list[ExitTrace]:
    from tqdm import tqdm

    out = []
    for r in tqdm(rows[:limit], desc="s2d tune: teacher-forced exits", disable=not progress):
        ids = torch.tensor([r.prompt_ids + r.output])
        start = len(r.prompt_ids)
        hidden = model.exit_hidden(ids[:, :-1])
        target = torch.tensor(r.output)
        hits, conf = [], []
        for h in hidden:
            small = model.head_logits(h[0, start - 1:]).float()
            probs = torch.softmax(small, -1)
            c, j = probs.max(-1)
            hits.append(model.token_ids[j] == target)
            conf.append(c)
        out.append(ExitTrace(start, torch.stack(hits), torch.stack(conf)))
    return out


class _Lazy:
    """Integer bookkeeping of ExitState: layer-token evaluations per feed."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes  # layers per segment
        self.done = [0] * len(sizes)
        self.total = 0

    def feed(self, n: int, exit_index: int) -> int:
        self.total += n
        work = 0
        for s in range(exit_index + 1):
            work += (self.total - self.done[s]) * self.sizes[s]
            self.done[s] = self.total
        return work

    def truncate(self, n: int) -> None:
        self.total = min(self.total, n)
        self.done = [min(d, n) for d in self.done]


@dataclass
class Simulated:
    thresholds: tuple[float, ...]
    k: int
    tokens: int
    ms: float
    plain_ms: float
    target_calls: int
    exit_share: list[float]

    @property
    def speedup(self) -> float:
        return self.plain_ms / self.ms if self.ms else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.tokens / self.target_calls if self.target_calls else 0.0


def simulate(traces: list[ExitTrace], exits: tuple[int, ...], thresholds: tuple[float, ...],
             k: int, costs: ExitCosts, target_ms) -> Simulated:
    """Greedy chains of k with early exits over every trace (see the module docstring)."""
    sizes = [b - a for a, b in zip((0, *exits[:-1]), exits, strict=True)]
    th = torch.tensor([*thresholds, -1.0])[:, None]
    tokens = calls = 0
    ms = plain = 0.0
    used = [0] * len(exits)
    for tr in traces:
        n = tr.hits.shape[1]
        # exit of each position: the first whose confidence reaches its threshold
        exit_at = (tr.conf >= th).int().argmax(0).tolist()
        hit = tr.hits[exit_at, torch.arange(n)].tolist()
        reach = next((i for i, t in enumerate(thresholds) if t <= 0.0), len(exits) - 1)
        lazy = _Lazy(sizes)
        lazy.feed(tr.context - 1, reach)  # the prompt prefill, every reachable layer, batched
        # (timed as the draft's prefill, apart from decoding, as the engine does)
        cached = tr.context - 1
        i = 0  # output tokens emitted so far
        while i < n:
            ctx = tr.context + i
            if cached == ctx:  # the last token's logits are needed again
                lazy.truncate(ctx - 1)
                cached = ctx - 1
            pending = ctx - cached
            depth = min(k, n - i)
            m = 0
            for j in range(depth):
                e = exit_at[i + j]
                used[e] += 1
                ms += costs.feed_ms(lazy.feed(pending if j == 0 else 1, e), e + 1)
                if m == j and hit[i + j]:
                    m += 1
            cached = ctx + depth - 1
            ms += target_ms(depth + 1, ctx)
            plain += sum(target_ms(1, ctx + t) for t in range(min(m + 1, n - i)))
            calls += 1
            emitted = min(m + 1, n - i)
            tokens += emitted
            i += emitted
            keep = ctx + min(m, depth - 1) if depth else ctx
            lazy.truncate(keep)
            cached = min(cached, keep)
    total = sum(used) or 1
    return Simulated(tuple(thresholds), k, tokens, ms, plain, calls, [u / total for u in used])


def best_single_exit(traces: list[ExitTrace], exits: tuple[int, ...], index: int,
                     costs: ExitCosts, target_ms, ks) -> Simulated:
    """Drafting with one exit alone (`s2d:...,exit=N`: only its layers run), at its best k."""
    alone = [ExitTrace(t.context, t.hits[index:index + 1], t.conf[index:index + 1])
             for t in traces]
    return max((simulate(alone, (exits[index],), (), k, costs, target_ms) for k in ks),
               key=lambda r: r.tokens / r.ms)


def grid_search(traces, exits, costs, target_ms, ks, grid) -> list[Simulated]:
    out = []
    for k in ks:
        for combo in itertools.product(grid, repeat=len(exits) - 1):
            out.append(simulate(traces, exits, combo, k, costs, target_ms))
    return out


# ----------------------------------------------------------------------------- command
# (its arguments: `cli/s2d.py`)
def run_tune(args: argparse.Namespace) -> int:
    from adaspec.backends.load import load_backends
    from adaspec.cost.cache import profile_for
    from adaspec.cost.profile import load_profile
    from adaspec.draft import s2d_artifact
    from adaspec.engine.overhead import loop_overhead_ms
    from adaspec.lab.s2d.data import read_meta, read_rows
    from adaspec.store.atomic import write_json

    ks = [int(x) for x in args.k.split(",")]
    grid = [float(x) for x in args.grid.split(",")]
    if not ks or min(ks) < 1 or not grid:
        raise InputError("--k needs draft lengths >= 1 and --grid at least one value")
    folder = s2d_artifact.resolve(args.artifact)
    model, manifest = s2d_artifact.load_for_drafting(folder, args.draft_weights)
    meta = read_meta(args.data)
    rows = [r for r in read_rows(args.data) if r.split == "val" and r.output]
    if not rows:
        raise InputError(f"no validation rows in {args.data}")
    target, _, _, _ = load_backends(args.target, None, args.dtype, args.weights, "none")
    if meta["target"] != target.name:
        raise InputError(f"{args.data} holds {meta['target']}'s outputs, not {target.name}'s")
    profile = (load_profile(args.profile) if args.profile
               else profile_for(target, None, loop_overhead=loop_overhead_ms))
    print(f"s2d tune: measuring the exits' costs on this machine ({args.draft_weights})",
          file=sys.stderr)
    costs = measure_exit_costs(model)
    traces = trace_rows(model, rows, args.limit, progress=not args.no_progress)
    exits = model.config.exits
    results = grid_search(traces, exits, costs, profile.target_ms, ks, grid)
    best = max(results, key=lambda r: r.tokens / r.ms)
    single = {f"exit {e}": best_single_exit(traces, exits, i, costs, profile.target_ms, ks)
              for i, e in enumerate(exits)}
    label = " (SIMULATED profile)" if profile.simulated else ""
    print(f"s2d tune{label}: {target.name}: best thresholds {list(best.thresholds)}, k={best.k}: "
          f"predicted {best.speedup:.2f}x over plain decoding, {best.mean_accepted:.2f} "
          f"tokens per target call, exit share {[round(s, 3) for s in best.exit_share]}",
          file=sys.stderr)
    for name, r in single.items():
        print(f"  {name} alone (k={r.k}): predicted {r.speedup:.2f}x, MAT "
              f"{r.mean_accepted:.2f}", file=sys.stderr)
    top1 = {f"exit {e}": round(float(torch.cat([t.hits[i] for t in traces]).float().mean()), 4)
            for i, e in enumerate(exits)}
    print(f"  top-1 agreement with {target.name}'s outputs per exit: {top1}", file=sys.stderr)
    record = {
        "thresholds": list(best.thresholds), "k": best.k, "exit_top1": top1,
        "predicted_speedup": round(best.speedup, 4),
        "predicted_mean_accepted": round(best.mean_accepted, 4),
        "exit_share": [round(s, 4) for s in best.exit_share],
        "single_exit_predicted": {n: {"k": r.k, "speedup": round(r.speedup, 4),
                                      "mean_accepted": round(r.mean_accepted, 4)}
                                  for n, r in single.items()},
        "exit_costs_ms": asdict(costs), "draft_weights": args.draft_weights,
        "profile": profile.source, "simulated": profile.simulated,
        "val_rows": len(traces), "data_sha256": meta.get("rows_sha256"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if args.report:
        per_setting: dict[tuple[float, ...], Simulated] = {}  # the best k of each setting
        for r in results:
            kept = per_setting.get(r.thresholds)
            if kept is None or r.tokens / r.ms > kept.tokens / kept.ms:
                per_setting[r.thresholds] = r
        grid_rows = [{"thresholds": list(r.thresholds), "k": r.k,
                      "speedup": round(r.speedup, 3), "mean_accepted": round(r.mean_accepted, 3),
                      "exit_share": [round(s, 3) for s in r.exit_share]}
                     for r in per_setting.values()]
        write_json(args.report, {"target": target.name, "exits": list(exits), **record,
                                 "grid": grid_rows}, indent=None)
    if not args.no_store:
        if profile.simulated:
            raise InputError("a simulated profile's thresholds are not stored (they would "
                             "drive real decoding); use --no-store with --report")
        stored = dict(manifest.get("thresholds") or {})
        stored[target.name] = record
        s2d_artifact.update_manifest(folder, thresholds=stored)
        print(f"s2d tune: stored in {folder / s2d_artifact.MANIFEST}", file=sys.stderr)
    return 0
