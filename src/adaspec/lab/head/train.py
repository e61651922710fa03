"""Training a draft head (`draft/head_model.py`) on recorded target features (`lab/head/data`),
with the loss of `draft/head_loss.py` (which online learning on served requests shares).

`evaluate` reports, per depth, how often the head's top token is the target's top token
(greedy acceptance given the earlier drafts were right), on held-out examples.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from adaspec.draft.head_loss import (  # noqa: F401 - Frozen, kept_index: the trainer's too
    Frozen,
    head_losses,
    kept_index,
    row_agreement,
    unrolled,
)
from adaspec.draft.head_model import DraftHead, HeadConfig, TokenHead


@dataclass
class TrainConfig:
    depth: int = 2  # draft steps the loss unrolls
    epochs: int = 2
    lr: float = 3e-4
    feature_weight: float = 1.0  # smooth-L1 on the feature beside the token loss (EAGLE)
    noise: float = 0.0  # uniform noise on the input features (EAGLE-1's robustness trick)
    features: str = "final"  # "final" (EAGLE) or "layers" (EAGLE-3's low/mid/high)
    seed: int = 0
    log_every: int = 50
    bf16: bool = False  # autocast the head's products to bf16 (AMX / AVX-512 bf16: ~3x)


def frozen_parts(model, token_ids: torch.Tensor) -> Frozen:
    embed = model.get_input_embeddings().weight.detach()
    out = model.get_output_embeddings().weight.detach()
    head = TokenHead(out[token_ids].float().clone(), token_ids, out.shape[0])
    return Frozen(embed, head, kept_index(token_ids, out.shape[0]))


def kept_tokens(rows: list[dict], size: int, vocab: int, always: list[int]) -> torch.Tensor:
    """The `size` tokens the target chose most often in the training rows (FR-Spec), the
    `always` ones (end of turn) included; sorted ids."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for r in rows:
        counts += torch.bincount(r["top_ids"][:, 0].long(), minlength=vocab)
        counts += torch.bincount(r["tokens"].long(), minlength=vocab)
    counts[always] = counts.max() + 1
    ids = counts.topk(min(size, vocab)).indices
    return ids.sort().values


@dataclass
class Report:
    steps: int = 0
    seconds: float = 0.0
    train_accuracy: list[float] = field(default_factory=list)
    held_out: list[float] = field(default_factory=list)  # per depth
    history: list[dict] = field(default_factory=list)


def train(head: DraftHead, frozen: Frozen, rows: list[dict], held: list[dict],
          cfg: TrainConfig, progress: bool = True, checkpoint: Path | None = None) -> Report:
    """Train in place. checkpoint: written atomically after every epoch (the head, the
    optimizer, the schedule, the report), and read first where it exists, so a killed run
    resumes at its last finished epoch."""
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    total = cfg.epochs * len(rows)
    def rate(step: int) -> float:  # warm up over 50 examples, then a cosine to 0
        return min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)
    report = Report()
    first_epoch = 0
    if checkpoint is not None and checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=False)
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["schedule"])
        report = saved["report"]
        first_epoch = int(saved["epoch"]) + 1
    t0 = time.perf_counter() - report.seconds
    hits = [[0, 0] for _ in range(cfg.depth)]
    g = torch.Generator().manual_seed(cfg.seed)
    bar = tqdm(total=total, initial=first_epoch * len(rows), desc="head training",
               unit="example", disable=not progress)
    for epoch in range(cfg.epochs):
        order = torch.randperm(len(rows), generator=g).tolist()  # drawn for every epoch
        if epoch < first_epoch:
            continue
        for i in order:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                outs = unrolled(head, frozen, rows[i], cfg, cfg.depth, cfg.noise)
                loss, h = head_losses(frozen, rows[i], outs, cfg)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            sched.step()
            report.steps += 1
            for d, (a, b) in enumerate(h):
                hits[d][0] += a
                hits[d][1] += b
            bar.update(1)
            if report.steps % cfg.log_every == 0:
                acc = [a / max(1, b) for a, b in hits]
                bar.set_postfix(loss=f"{float(loss):.3f}", acc="/".join(f"{x:.2f}" for x in acc))
                report.history.append({"step": report.steps, "epoch": epoch,
                                       "loss": float(loss), "train_acc": acc})
                hits = [[0, 0] for _ in range(cfg.depth)]
        if held:
            acc = evaluate(head, frozen, held, cfg, max(cfg.depth, 3))
            report.history.append({"epoch": epoch, "held_out": acc})
            bar.write(f"epoch {epoch}: held-out greedy agreement by depth "
                      + " / ".join(f"{a:.3f}" for a in acc))
        if checkpoint is not None:
            from adaspec.store.atomic import atomic_open

            report.seconds = time.perf_counter() - t0
            with atomic_open(checkpoint, "wb") as f:
                torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(),
                            "schedule": sched.state_dict(), "report": report,
                            "epoch": epoch}, f)
    bar.close()
    report.seconds = time.perf_counter() - t0
    if held:
        report.held_out = evaluate(head, frozen, held, cfg, max(cfg.depth, 3))
    return report


def evaluate(head: DraftHead, frozen: Frozen, rows: list[dict], cfg: TrainConfig,
             depth: int, prompt_window: int | None = None) -> list[float]:
    """Per depth: the share of answer positions where the head's top token is the target's.
    prompt_window: the head sees the features of only the last this-many + 1 prompt positions
    (0: the last one, what a runtime scoring the prompt's last row gives; None: all)."""
    hits = [[0, 0] for _ in range(depth)]
    for row in rows:
        start = max(0, int(row["prompt_len"]) - 1)
        visible = 0 if prompt_window is None else max(0, start - prompt_window)
        for d, (a, b) in enumerate(row_agreement(head, frozen, row, cfg, depth, visible)):
            hits[d][0] += a
            hits[d][1] += b
    return [a / max(1, b) for a, b in hits]


def new_head(config, intermediate: int, features: int, heads: int = 0) -> DraftHead:
    """A fresh head for a target's transformers config (or a model carrying one); heads:
    query heads (0: the target's)."""
    config = getattr(config, "config", config)
    return DraftHead(HeadConfig.from_target(config, intermediate, features, heads))
