"""Which draft head to build (issue 65): features recorded once, several heads trained on them.

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/head_study.py \
        --train 240 --held 24 --out experiments/results/head-study

Records the built-in target's features (torch, bf16) over ShareGPT answers: training
examples from file indices below 12,000 (DESIGN.md), held-out ones from 12,000 on. Then
trains each head variant (`--variants`) on the same rows and reports, per depth, how often its
top token is the target's top token on the held-out answers (teacher-forced: the earlier
drafts taken as right), its parameters and its seconds per draft step at batch 1 (torch,
bf16 and fp32, this machine). Writes `study.json` and `study.md` under --out; the recorded
features stay under --data (not committed).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from adaspec.draft import head_artifact  # noqa: E402
from adaspec.lab.head import data as head_data  # noqa: E402
from adaspec.lab.head import train as head_train  # noqa: E402

VARIANTS = {  # name: (MLP width, fused features, depth unrolled in training)
    "eagle-2048-d2": (2048, "final", 2),
    "eagle3-2048-d2": (2048, "layers", 2),
    "eagle-2048-d1": (2048, "final", 1),
    "eagle-4096-d2": (4096, "final", 2),
}


def step_ms(head, frozen, dtype: torch.dtype, context: int = 256, reps: int = 30) -> float:
    """ms of one draft step at batch 1 (the drafter's own measure, `HeadDrafter.step_ms`)."""
    from adaspec.draft.head import HeadDrafter

    tokens = frozen.token_head.to(dtype)
    try:
        return HeadDrafter(head.to(dtype), tokens, frozen.embed).step_ms(context, reps)
    finally:
        head.layer.unfuse()  # the drafter fused its products; training reads the separate ones
        head.float()
        frozen.token_head.float()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--train", type=int, default=240, help="training examples")
    p.add_argument("--held", type=int, default=24, help="held-out examples")
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--vocab", type=int, default=32768, help="kept tokens of the output head")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--data", default="/tmp/head-study-data")
    p.add_argument("--out", default="experiments/results/head-study")
    args = p.parse_args()

    from adaspec.backends.load import load_backends

    torch.set_num_threads(max(1, torch.get_num_threads()))
    target, tokenizer, _, eos = load_backends(draft=None, weights="none")
    model = target.model.eval()
    data = Path(args.data)
    train_ex = list(head_data.sharegpt_pairs(0, head_data.TRAIN_SHAREGPT))[: args.train]
    held_ex = list(head_data.sharegpt_pairs(head_data.TRAIN_SHAREGPT, 10**9))[: args.held]
    m_train = head_data.collect(head_data.TorchScorer(model, True), tokenizer, train_ex,
                                data / "train", args.max_tokens)
    m_held = head_data.collect(head_data.TorchScorer(model, True), tokenizer, held_ex,
                               data / "held", args.max_tokens)
    rows = head_data.load_rows(data / "train")
    held = head_data.load_rows(data / "held")
    vocab = model.config.vocab_size
    token_ids = head_train.kept_tokens(rows, args.vocab, vocab, list(eos))
    frozen = head_train.frozen_parts(model, token_ids)
    coverage = sum(int((frozen.index[r["top_ids"][1:, 0].long()] >= 0).sum()) for r in held) \
        / sum(len(r["tokens"]) - 1 for r in held)
    results = {"machine": platform.processor() or platform.machine(), "date":
               time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
               "train_tokens": m_train.get("tokens"), "held_tokens": m_held.get("tokens"),
               "collect_seconds": m_train.get("seconds", 0) + m_held.get("seconds", 0),
               "vocab": args.vocab, "held_coverage": coverage, "variants": {}}
    for name in args.variants.split(","):
        width, feats, depth = VARIANTS[name]
        head = head_train.new_head(model, width, 3 if feats == "layers" else 1)
        cfg = head_train.TrainConfig(depth=depth, epochs=args.epochs, features=feats)
        report = head_train.train(head, frozen, rows, held, cfg)
        results["variants"][name] = {
            "mlp": width, "features": feats, "train_depth": depth,
            "params": sum(p.numel() for p in head.parameters()),
            "held_out_by_depth": report.held_out, "train_seconds": report.seconds,
            "held_out_last_prompt_row_only": head_train.evaluate(
                head, frozen, held, cfg, 3, prompt_window=0),
            "step_ms_fp32": step_ms(head, frozen, torch.float32),
            "step_ms_bf16": step_ms(head, frozen, torch.bfloat16),
            "history": report.history,
        }
        print(name, json.dumps({k: v for k, v in results["variants"][name].items()
                                if k != "history"}), flush=True)
        head_artifact.save(data / f"{name}.pt", head, token_ids, {
            "trained_on": f"ShareGPT conversations {train_ex[0].id} .. {train_ex[-1].id} "
                          f"(file index < {head_data.TRAIN_SHAREGPT}), their first answer",
            "command": " ".join(sys.argv), "date": results["date"],
            "machine": results["machine"], "variant": name})
        write_report(results, Path(args.out))
    return 0


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json.dumps(results, indent=1))
    lines = ["| variant | MLP | features | trained depth | params (M) "
             "| held-out agreement d1 / d2 / d3 | the same, last prompt row only "
             "| step ms fp32 / bf16 |",
             "| --- | ---: | --- | ---: | ---: | --- | --- | --- |"]
    for name, v in results["variants"].items():
        acc = " / ".join(f"{a:.3f}" for a in v["held_out_by_depth"])
        last = " / ".join(f"{a:.3f}" for a in v["held_out_last_prompt_row_only"])
        lines.append(f"| {name} | {v['mlp']} | {v['features']} | {v['train_depth']} | "
                     f"{v['params'] / 1e6:.1f} | {acc} | {last} | {v['step_ms_fp32']:.2f} / "
                     f"{v['step_ms_bf16']:.2f} |")
    (out / "study.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
