"""What one draft step of the head costs on this machine, by shape and weight format (issue 65).

    .venv/bin/python experiments/head_cost.py --out experiments/results/head-cost-<machine>

Random-init heads of the built-in target's shapes (hidden 1536, 12 query heads of 128, 2
key/value heads) at batch 1 over a cache of 256 positions, with the output head restricted
to N kept tokens; each configuration timed over the same loop the drafter runs (one head
step, the kept-token logits, their argmax). Reported beside the target's plain step from
this machine's cost profile (`adaspec profile`), so the ratio is the figure that decides.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from adaspec.draft.head import WEIGHTS, HeadDrafter, serving_head, weights_dtype  # noqa: E402
from adaspec.draft.head_model import DraftHead, HeadConfig, TokenHead  # noqa: E402
from adaspec.store.quant import quantize_model  # noqa: E402


def step_ms(head: DraftHead, tokens: TokenHead, context: int = 256, reps: int = 40) -> float:
    """The drafter's own measure (`HeadDrafter.step_ms`): one head step and its logits."""
    embed = torch.zeros(1, head.cfg.hidden)  # the step reads one token's row
    return HeadDrafter(head, tokens, embed).step_ms(context, reps)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mlp", default="512,1024,2048")
    p.add_argument("--heads", default="4,12")
    p.add_argument("--vocab", default="8192,16384,32768")
    p.add_argument("--formats", default=",".join(WEIGHTS),
                   help="the drafter's run-time weights (`head:weights=`): "
                   + ", ".join(WEIGHTS))
    p.add_argument("--target-ms", type=float, default=0.0,
                   help="the target's one-token step in ms, for the ratio (the cost "
                   "profile's first point: adaspec profile); 0 leaves it out")
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.manual_seed(0)
    target_ms = args.target_ms
    rows = []
    for mlp, heads, vocab, fmt in itertools.product(
            [int(x) for x in args.mlp.split(",")], [int(x) for x in args.heads.split(",")],
            [int(x) for x in args.vocab.split(",")], args.formats.split(",")):
        cfg = HeadConfig(hidden=1536, heads=heads, kv_heads=2, head_dim=128, intermediate=mlp)
        if fmt not in WEIGHTS:
            p.error(f"--formats: {fmt} is not one of {', '.join(WEIGHTS)}")
        dtype = weights_dtype(fmt)
        head = serving_head(DraftHead(cfg), fmt)  # as the drafter runs it
        tokens = TokenHead(torch.randn(vocab, 1536, dtype=dtype) * 0.02,
                           torch.arange(vocab), 151936).eval()
        if fmt.startswith("int8"):
            quantize_model(tokens, fmt)
        ms = step_ms(head, tokens)
        params = sum(p.numel() for p in DraftHead(cfg).parameters())
        row = {"mlp": mlp, "heads": heads, "vocab": vocab, "format": fmt,
               "head_params_m": round(params / 1e6, 2), "step_ms": round(ms, 3)}
        if target_ms:
            row["of_target_step"] = round(ms / target_ms, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        summary = {"machine": platform.processor() or platform.machine(),
                   "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                   "torch_threads": torch.get_num_threads(), "target_step_ms": target_ms,
                   "rows": rows}
        (out / "cost.json").write_text(json.dumps(summary, indent=1))
        lines = ["| MLP | query heads | kept tokens | format | head params (M) | ms a draft step"
                 " | of a target step |", "| ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
        lines += [f"| {r['mlp']} | {r['heads']} | {r['vocab']} | {r['format']} | "
                  f"{r['head_params_m']} | {r['step_ms']} | {r.get('of_target_step', '-')} |"
                  for r in rows]
        (out / "cost.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
