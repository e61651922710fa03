"""What a draft-head step costs in torch (int8 rows, bf16 activations: `head:weights=int8`)
against its layer in ik_llama.cpp (`head:weights=ggml`), cache-warm and after the caches are
flushed (as after a target call), and how far their outputs are apart.

    python experiments/head_ggml.py --out experiments/results/head-ggml-epyc-avx512

Both drafters are the shipped head of the built-in target, loaded as the method loads them;
each step is the drafter's own: fc, the layer over a cache of `--context` positions, the kept
tokens' logits, and the argmax.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from adaspec.core.sampling import SamplingParams
from adaspec.draft.builtin import head_file
from adaspec.draft.head_ggml import load_drafter

TARGET = "qwen2.5-coder-1.5b-instruct"


class _Target:
    name = TARGET


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--flush-mb", type=int, default=400, help="bytes streamed between steps")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)
    path = head_file(TARGET)
    drafters = {w: load_drafter(path, _Target(), w) for w in ("int8", "ggml")}
    junk = torch.zeros(args.flush_mb * 2**20 // 4)
    rows = {}
    for weights, drafter in drafters.items():
        step = drafter.probe_step(args.context)
        for cold in (False, True):
            times = []
            for _ in range(args.reps + 3):
                if cold:
                    junk.add_(1.0)
                t0 = time.perf_counter()
                step()
                times.append(1000 * (time.perf_counter() - t0))
            times = sorted(times[3:])
            rows[f"{weights} {'after a flush' if cold else 'warm'}"] = {
                "median_ms": round(statistics.median(times), 3),
                "p10_ms": round(times[len(times) // 10], 3)}
    # the two heads' next-token logits over the same inputs (random features, real tokens)
    g = torch.Generator().manual_seed(0)
    agree, n = 0, 64
    for i in range(n):
        feats = torch.randn(1, 1536, generator=g)
        feats = feats / feats.norm() * 1536 ** 0.5
        token = int(torch.randint(0, 150000, (1,), generator=g))
        tops = []
        for drafter in drafters.values():
            chain = _chain_at(drafter, feats, token, 1 + i)
            drawn, _, _ = chain.draw(SamplingParams(0.0), None)
            tops.append(int(drawn))
        agree += tops[0] == tops[1]
    summary = {"machine": {"cpu": _cpu(), "python": platform.python_version(),
                           "torch": torch.__version__, "threads": 2},
               "context": args.context, "flush_mb": args.flush_mb, "steps": rows,
               "same_argmax_of_64": agree}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cost.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


def _chain_at(drafter, feats: torch.Tensor, token: int, position: int):
    """A chain whose first output reads `feats` and `token` at `position` (a fresh cache)."""
    from adaspec.draft.head import HeadChain
    from adaspec.draft.head_ggml import GgmlChain, GgmlHeadDrafter

    if isinstance(drafter, GgmlHeadDrafter):
        drafter.cache.remove_from(0)
        hidden, small = drafter.cache.decode(drafter.rows(feats, [token]), [position])
        return GgmlChain(drafter, hidden, small, position + 1)
    with torch.no_grad():
        hidden, kv = drafter.head(feats.to(drafter._dtype)[None], drafter._embeds([token]),
                                  torch.tensor([[position]]))
    return HeadChain(drafter, hidden, kv, position + 1)


def _cpu() -> str:
    from adaspec.store.native_build import cpu_model

    return cpu_model()


if __name__ == "__main__":
    raise SystemExit(main())
