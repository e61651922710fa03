"""One distillation update: optimizer steps of the student toward the target's recorded
distributions, and the guard that decides whether the result may serve.

Sampling (OSD's ablation): `teacher` trains on the served tokens (the target's own output,
where the draft missed); `student` lets the draft write a short continuation from a recorded
context and has the target score it; `mixed` picks one of the two per sample.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from adaspec.errors import InputError
from adaspec.online.losses import Loss, parse_loss
from adaspec.online.record import RequestRecord
from adaspec.online.student import Student

SAMPLINGS = ("teacher", "student", "mixed")
# (tokens, start) -> the target's top-k (ids, probs) of tokens[p], p = start .. len - 1
TargetScorer = Callable[[list[int], int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class DistillConfig:
    loss: str = "jsd:0.5"
    sampling: str = "teacher"
    steps: int = 8  # optimizer steps per update
    batch: int = 4  # records per step
    lr: float = 1e-5  # measured: 3e-5 and above lowered probe agreement (docs/osd.md)
    max_positions: int = 128  # recorded positions per record and step (a random subset)
    student_tokens: int = 8  # tokens the draft writes per student sample
    seed: int = 0

    def __post_init__(self) -> None:
        parse_loss(self.loss)
        if self.sampling not in SAMPLINGS:
            raise InputError(f"sampling must be one of {SAMPLINGS}, got {self.sampling!r}")
        for name in ("steps", "batch", "max_positions", "student_tokens"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise InputError(f"the learning rate must be > 0, got {self.lr}")

    @property
    def loss_fn(self) -> Loss:
        return parse_loss(self.loss)


@dataclass
class Sample:
    tokens: list[int]
    positions: list[int]
    top_ids: torch.Tensor
    top_probs: torch.Tensor
    cached: bool  # the tokens are a served sequence (their boundary is worth caching)


def teacher_sample(record: RequestRecord, limit: int, rng: random.Random) -> Sample:
    idx = list(range(len(record)))
    if len(idx) > limit:
        idx = sorted(rng.sample(idx, limit))
    return Sample(record.tokens, [record.positions[i] for i in idx], record.top_ids[idx],
                  record.top_probs[idx], True)


@torch.no_grad()
def student_sample(student: Student, record: RequestRecord, n: int, rng: random.Random,
                   scorer: TargetScorer) -> Sample:
    """The draft continues a recorded context for n tokens (sampling at temperature 1); the
    target's distributions at those tokens are the labels."""
    from transformers import DynamicCache

    start = rng.choice(record.positions)
    context = list(record.tokens[:start])
    gen = torch.Generator().manual_seed(rng.getrandbits(62))
    config: Any = student.model.config  # a transformers config
    cache = DynamicCache(config=config)
    feed = torch.tensor([context], device=student.device)
    out: list[int] = []
    for _ in range(n):
        logits = student.model(input_ids=feed, past_key_values=cache, use_cache=True).logits
        probs = torch.softmax(logits[0, -1].float(), -1).cpu()  # drawn by the CPU generator
        token = int(torch.multinomial(probs, 1, generator=gen))
        out.append(token)
        feed = torch.tensor([[token]], device=student.device)
    tokens = context + out
    ids, probs = scorer(tokens, start)
    return Sample(tokens, list(range(start, len(tokens))), ids, probs, False)


@dataclass
class UpdateStats:
    steps: int
    positions: int
    loss_first: float
    loss_last: float
    seconds: float
    finite: bool


def distill(student: Student, optimizer: torch.optim.Optimizer,
            records: Sequence[RequestRecord], cfg: DistillConfig,
            scorer: TargetScorer | None = None, rng: random.Random | None = None
            ) -> UpdateStats:
    """cfg.steps optimizer steps over random batches of `records`."""
    rng = rng or random.Random(cfg.seed)
    usable = [r for r in records if len(r)]
    if not usable:
        raise InputError("nothing to distil: the buffer holds no recorded positions")
    if cfg.sampling != "teacher" and scorer is None:
        raise InputError(f"sampling={cfg.sampling} needs the target to score the draft's "
                         "samples")
    loss_fn = cfg.loss_fn
    t0 = time.perf_counter()
    losses: list[float] = []
    positions = 0
    finite = True
    for _ in range(cfg.steps):
        batch = [rng.choice(usable) for _ in range(min(cfg.batch, len(usable)))]
        samples = []
        for record in batch:
            own = cfg.sampling == "student" or (cfg.sampling == "mixed" and rng.random() < 0.5)
            # own: sampling is not "teacher", so a scorer was given (checked above)
            samples.append(student_sample(student, record, cfg.student_tokens, rng,
                                          cast("TargetScorer", scorer))
                           if own else teacher_sample(record, cfg.max_positions, rng))
        total = sum(len(s.positions) for s in samples)
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for s in samples:
            logq = student.log_probs(s.tokens, s.positions, cache=s.cached)
            loss = loss_fn(logq, s.top_ids.to(student.device), s.top_probs.to(student.device)
                           ) * (len(s.positions) / total)
            loss.backward()
            step_loss += float(loss.detach())
        if not math.isfinite(step_loss):
            finite = False
            break
        optimizer.step()
        losses.append(step_loss)
        positions += total
    finite = finite and student.finite()
    return UpdateStats(len(losses), positions, losses[0] if losses else float("nan"),
                       losses[-1] if losses else float("nan"), time.perf_counter() - t0,
                       finite)


@torch.no_grad()
def agreement(student: Student, records: Sequence[RequestRecord]) -> float:
    """How often the draft's greedy guess is the served token, over the records' outputs: a
    greedy chain's acceptance follows it (the guard's probe)."""
    hits = total = 0
    for r in records:
        if len(r.tokens) <= r.prompt_len:
            continue
        guess = student.predictions(r.tokens, r.prompt_len)
        hits += int((guess == torch.tensor(r.output)).sum())
        total += len(r.output)
    return hits / total if total else float("nan")
