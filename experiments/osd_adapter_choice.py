"""Which part of the draft online distillation trains, measured on this CPU (docs/osd.md):
the last layers (the student of adaspec.online, frozen layers below computed once per
sequence) or LoRA adapters on every layer (peft). One distillation step each, on the same
batch, alternating, after a warm-up; prints ms per step and peak memory of the parameters
that learn.

    python experiments/osd_adapter_choice.py --draft qwen2.5-coder-0.5b-instruct --out DIR
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--data", default=None, help="an `adaspec s2d data` folder (real sequences)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from peft import LoraConfig, get_peft_model

    from adaspec.lab.s2d.data import default_data_dir, read_rows
    from adaspec.online.losses import parse_loss
    from adaspec.online.record import compact
    from adaspec.online.student import Student
    from adaspec.store.loading import load_model

    rows = read_rows(args.data or default_data_dir("qwen2.5-coder-1.5b-instruct"))[:4]
    model = load_model(args.draft, "bfloat16").model.float()
    loss_fn = parse_loss("jsd:0.5")
    batch = []
    for r in rows:  # 32 positions per sequence, labels: a perturbed copy of the draft itself
        tokens = r.prompt_ids + r.output
        positions = list(range(len(r.prompt_ids) + 1, len(tokens)))[:32]
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, [p - 1 for p in positions]]
        ids, probs = compact(logits + torch.randn_like(logits), 32)
        batch.append((tokens, positions, ids, probs))

    student = Student(copy.deepcopy(model), args.layers)
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))
    opt_s = torch.optim.AdamW(student.params, lr=1e-5)
    opt_l = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-4)

    def step_student() -> None:
        opt_s.zero_grad()
        for tokens, positions, ids, probs in batch:
            loss_fn(student.log_probs(tokens, positions), ids, probs).backward()
        opt_s.step()

    def step_lora() -> None:
        opt_l.zero_grad()
        for tokens, positions, ids, probs in batch:
            logits = lora(torch.tensor([tokens])).logits[0, [p - 1 for p in positions]]
            loss_fn(torch.log_softmax(logits.float(), -1), ids, probs).backward()
        opt_l.step()

    def first_student_step() -> None:  # boundaries not yet cached: what a new record costs
        student._boundaries.clear()
        step_student()

    variants = {f"last {args.layers} layers (boundary cached)": step_student,
                f"last {args.layers} layers (first sight of the batch)": first_student_step,
                f"LoRA r={args.rank} on every layer (peft)": step_lora}
    for fn in variants.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1000)
    trained = {
        f"last {args.layers} layers (boundary cached)": sum(p.numel() for p in student.params),
        f"last {args.layers} layers (first sight of the batch)":
            sum(p.numel() for p in student.params),
        f"LoRA r={args.rank} on every layer (peft)":
            sum(p.numel() for p in lora.parameters() if p.requires_grad),
    }
    result = {"draft": args.draft, "sequences": len(batch),
              "tokens": [len(b[0]) for b in batch], "positions_per_sequence": 32,
              "threads": torch.get_num_threads(),
              "ms_per_step": {k: statistics.median(v) for k, v in times.items()},
              "trained_parameters": trained}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_choice.json").write_text(json.dumps(result, indent=2))
    lines = ["| what learns | trained parameters | ms per step (median) |", "|---|---|---|"]
    lines += [f"| {k} | {trained[k] / 1e6:.1f} M | {v:.0f} |"
              for k, v in result["ms_per_step"].items()]
    (out / "adapter_choice.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
