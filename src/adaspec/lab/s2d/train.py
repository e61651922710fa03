"""SoFT: sorted fine-tuning of a sorted draft on a target's greedy outputs.

The loss is the sum of every exit's cross-entropy (SoFT), or the last exit's alone (the SFT
baseline of the same size). The embeddings and the output head are frozen: they hold most of
a small model's parameters (2 x 136 M of the 0.5B's 630 M), they are shared by every exit,
and freezing them keeps the artifact small (it stores only the layers and the final norm).
Training runs in bf16 autocast over fp32 master weights, one sequence per micro-batch; a
checkpoint is written every `checkpoint_every` optimizer steps and `resume` picks it up.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F

from adaspec.draft import s2d_artifact
from adaspec.draft.sorted_model import SortedDraftLM
from adaspec.errors import InputError
from adaspec.lab.s2d.data import Row, read_meta, read_rows
from adaspec.store.atomic import atomic_path

CHECKPOINT = "checkpoint.pt"
MODES = ("soft", "sft")


@dataclass
class TrainConfig:
    data: str  # folder from `adaspec s2d data`
    out: str  # artifact folder
    source: str = "qwen2.5-coder-0.5b-instruct"
    exits: tuple[int, ...] = (6, 9, 12)
    mode: str = "soft"
    kept_tokens: int = 32768  # rows of the output head (0: the whole vocabulary)
    epochs: float = 1.0
    lr: float = 5e-5
    accumulate: int = 8  # sequences per optimizer step
    max_tokens: int = 512  # longest training sequence (prompt tail + output)
    warmup: int = 10  # optimizer steps of linear warm-up, then cosine decay
    checkpoint_every: int = 10
    seed: int = 0
    # weight of a self-distillation term: KL from the source model's own last layer to each
    # exit, at every position (prompt included); 0 is the paper's SoFT (cross-entropy only)
    distill: float = 0.0

    def check(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.epochs < 0 or self.lr <= 0 or self.accumulate < 1 or self.max_tokens < 8:
            raise InputError("need epochs >= 0, lr > 0, accumulate >= 1, max_tokens >= 8")
        if self.distill < 0:
            raise InputError("distill must be >= 0")
        if self.kept_tokens < 0:
            raise InputError("kept_tokens must be >= 0 (0 keeps the whole vocabulary)")


def kept_token_ids(rows: list[Row], size: int, vocab: int) -> torch.Tensor | None:
    """The head's token set: the tokens most frequent in the training rows (prompts and
    outputs), then the lowest ids not yet in (BPE ids roughly follow merge frequency)."""
    if size == 0 or size >= vocab:
        return None
    counts = Counter(t for r in rows if r.split == "train" for t in (*r.prompt_ids, *r.output))
    kept = [t for t, _ in counts.most_common(size)]
    seen = set(kept)
    for t in range(vocab):
        if len(kept) >= size:
            break
        if t not in seen:
            kept.append(t)
    return torch.tensor(sorted(kept))


def sequences(rows: list[Row], max_tokens: int) -> list[tuple[list[int], int]]:
    """(ids, first output index) per training row, the prompt cut from the left to fit."""
    out = []
    for r in rows:
        if r.split != "train" or not r.output:
            continue
        output = r.output[: max_tokens - 1]
        prompt = r.prompt_ids[-(max_tokens - len(output)):]
        out.append((prompt + output, len(prompt)))
    return out


def exit_losses(model: SortedDraftLM, ids: list[int], start: int, column: torch.Tensor,
                teacher: SortedDraftLM | None = None, distill: float = 0.0
                ) -> tuple[list[torch.Tensor], int]:
    """Cross-entropy of each exit on the output tokens (positions start.. of `ids`), over
    the kept tokens; outputs outside the set are left out. With a teacher, plus `distill`
    times the KL from the teacher's distribution to the exit's at every position.
    (losses, tokens counted)"""
    x = torch.tensor([ids])
    labels = column[x[0, start:]]  # kept-set column of each output token, -1 outside
    hidden = model.exit_hidden(x[:, :-1])
    target_logp = None
    if teacher is not None and distill > 0:
        with torch.no_grad():
            t_hidden = teacher.exit_hidden(x[:, :-1])[-1]
            target_logp = torch.log_softmax(teacher.head_logits(t_hidden[0]).float(), -1)
    losses = []
    for h in hidden:
        if target_logp is None:
            logits = model.head_logits(h[0, start - 1:])
            losses.append(F.cross_entropy(logits.float(), labels, ignore_index=-1))
            continue
        logits = model.head_logits(h[0]).float()
        ce = F.cross_entropy(logits[start - 1:], labels, ignore_index=-1)
        kl = F.kl_div(torch.log_softmax(logits, -1), target_logp, log_target=True,
                      reduction="batchmean")
        losses.append(ce + distill * kl)
    return losses, int((labels >= 0).sum())


def _lr(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def train(cfg: TrainConfig, resume: bool = True, progress: bool = True) -> Path:
    """Extract, fine-tune and save a sorted draft; returns the artifact folder."""
    from tqdm import tqdm

    cfg.check()
    done = _finished(Path(cfg.out), cfg)
    if done is not None and resume:
        print(f"s2d train: {done} is already trained with these settings (--restart to train "
              "it again)")
        return done
    meta = read_meta(cfg.data)
    if not meta.get("complete"):
        raise InputError(f"{cfg.data} is not complete: finish `adaspec s2d data` first")
    rows = read_rows(cfg.data)
    seqs = sequences(rows, cfg.max_tokens)
    if not seqs and cfg.epochs > 0:
        raise InputError(f"no training rows in {cfg.data}")
    from adaspec.draft.s2d_artifact import source_files

    vocab = int(source_files(cfg.source)[2].vocab_size)
    token_ids = kept_token_ids(rows, cfg.kept_tokens, vocab)
    model, source = s2d_artifact.extract(cfg.source, tuple(cfg.exits), token_ids)
    teacher = None
    if cfg.distill > 0:  # the source model itself, every layer, the same head rows
        from adaspec.draft.s2d_artifact import source_files as _files

        depth = int(_files(cfg.source)[2].num_hidden_layers)
        teacher, _ = s2d_artifact.extract(cfg.source, (depth,), token_ids, torch.bfloat16)
        teacher.eval().requires_grad_(False)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(s2d_artifact.FROZEN))
    column = torch.full((vocab,), -1, dtype=torch.long)
    column[model.token_ids] = torch.arange(model.token_ids.numel())
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=0.0)
    total_steps = math.ceil(len(seqs) * cfg.epochs / cfg.accumulate)
    order = list(range(len(seqs)))
    random.Random(cfg.seed).shuffle(order)
    order = (order * math.ceil(cfg.epochs + 1))[: total_steps * cfg.accumulate]

    out = Path(cfg.out)
    ckpt_path = out / CHECKPOINT
    step, history, seconds = 0, [], 0.0
    if resume and ckpt_path.is_file():
        ckpt = torch.load(ckpt_path, weights_only=False)
        if ckpt["config"] != asdict(cfg):
            raise InputError(f"{ckpt_path} was written with other settings; use another --out "
                             "or --restart")
        model.load_state_dict(ckpt["model"], strict=False)
        opt.load_state_dict(ckpt["optimizer"])
        step, history, seconds = ckpt["step"], ckpt["history"], ckpt["seconds"]
        print(f"s2d train: resuming at step {step}/{total_steps}")

    names = [f"exit {e}" for e in cfg.exits]
    weights = [1.0] * len(cfg.exits) if cfg.mode == "soft" else [0.0] * (len(cfg.exits) - 1) + [1.0]
    model.train()
    bar = tqdm(total=total_steps, initial=step, desc=f"s2d train ({cfg.mode})",
               disable=not progress, unit="step")
    t0 = time.perf_counter() - seconds
    ema: list[float] | None = None
    while step < total_steps:
        for group in opt.param_groups:
            group["lr"] = _lr(step, total_steps, cfg)
        sums = [0.0] * len(cfg.exits)
        for i in order[step * cfg.accumulate:(step + 1) * cfg.accumulate]:
            ids, start = seqs[i]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses, counted = exit_losses(model, ids, start, column, teacher,
                                              cfg.distill)
            if not counted:  # every output token outside the kept set
                continue
            # a tensor: at least one weight is non-zero (the last exit's is always 1.0)
            loss = cast(torch.Tensor, sum(w * v for w, v in zip(weights, losses, strict=True) if w))
            (loss / cfg.accumulate).backward()
            for j, v in enumerate(losses):
                sums[j] += float(v.detach()) / cfg.accumulate
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        history.append(sums)
        ema = sums if ema is None else [0.9 * a + 0.1 * b for a, b in zip(ema, sums, strict=True)]
        bar.update(1)
        bar.set_postfix({n.replace("exit ", "L"): f"{v:.2f}" for n, v in zip(names, ema,
                                                                                strict=True)})
        if step % cfg.checkpoint_every == 0 or step == total_steps:
            _checkpoint(ckpt_path, model, opt, cfg, step, history, time.perf_counter() - t0)
    bar.close()
    seconds = time.perf_counter() - t0
    model.eval()
    tail = history[-max(1, len(history) // 5):]
    tail_mean = [sum(c) / len(tail) for c in zip(*tail, strict=True)] if tail else []
    manifest = {
        "name": out.name,
        "source": source,
        "data": {"folder": str(Path(cfg.data).resolve()), "target": meta["target"],
                 "rows_sha256": meta.get("rows_sha256"), "rows_by_suite":
                 meta.get("rows_by_suite"), "train_sequences": len(seqs),
                 "max_new_tokens": meta.get("max_new_tokens")},
        "training": {**asdict(cfg), "exits": list(cfg.exits), "steps": step,
                     "sequences_seen": step * cfg.accumulate, "seconds": round(seconds, 1),
                     "loss_first": dict(zip(names, history[0], strict=True)) if history else None,
                     "loss_last_fifth": dict(zip(names, tail_mean, strict=True))
                     if history else None,
                     "trained": "layers and final norm", "frozen": "embeddings, output head"},
        "thresholds": {},
    }
    s2d_artifact.save(model, out, manifest)
    ckpt_path.unlink(missing_ok=True)  # the optimizer state is 3x the weights: not kept
    return out


def _finished(out: Path, cfg: TrainConfig) -> Path | None:
    """The artifact folder if a finished run with the same settings is there."""
    if not (out / s2d_artifact.MANIFEST).is_file() or (out / CHECKPOINT).is_file():
        return None
    try:
        training = s2d_artifact.read_manifest(out).get("training") or {}
    except InputError:
        return None
    same = {k: v for k, v in training.items() if k in asdict(cfg)}
    mine = {**asdict(cfg), "exits": list(cfg.exits)}
    return out if same and all(mine[k] == v for k, v in same.items()) else None


def _checkpoint(path: Path, model, opt, cfg: TrainConfig, step: int, history: list,
                seconds: float) -> None:
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith(s2d_artifact.FROZEN)}
    with atomic_path(path) as tmp:
        torch.save({"model": state, "optimizer": opt.state_dict(), "config": asdict(cfg),
                    "step": step, "history": history, "seconds": seconds}, tmp)


def extract_only(source: str, exits: tuple[int, ...], data: str, kept_tokens: int, out: str
                 ) -> Path:
    """The untrained sorted draft (the same token set a training run on `data` would keep)."""
    rows = read_rows(data)
    from adaspec.draft.s2d_artifact import source_files

    vocab = int(source_files(source)[2].vocab_size)
    model, record = s2d_artifact.extract(source, exits, kept_token_ids(rows, kept_tokens, vocab))
    return s2d_artifact.save(model, out, {
        "name": Path(out).name, "source": record,
        "data": {"folder": str(Path(data).resolve()), "note": "token set only"},
        "training": None, "thresholds": {}})
