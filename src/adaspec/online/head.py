"""Online distillation of the draft head (OSD on the head, issue 66): the head keeps learning
from the requests it drafts for.

Why it is cheap: a served request already carries what the head learns from. The target's
final-normed state at every accepted position comes with the verification pass (the head
reads it to draft), and the token the target emitted after it is the label: greedy, it is the
target's top token; sampled, it is a draw from the target's distribution, an unbiased (if
noisier) stand-in for it. So learning needs no extra target call, and the head is small
(about 12M parameters): one optimizer step over a request of a few hundred tokens costs a
fraction of a second on a CPU.

`HeadRecorder` (a request's step hook) keeps, at every verification, the target's states of
the root and the accepted nodes and its distributions there (top-k), so a finished request
is a training row as `adaspec head data` records them. `HeadLearner` keeps a float copy of
the head (the serving head may be bf16 or int8), trains it with the loss the head was
trained with (`draft/head_loss.py`) on each finished request and a few earlier ones
(replay, against forgetting). The server's side is `online/head_service.py`.
"""

from __future__ import annotations

import copy
import logging
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from adaspec.draft.head_loss import Frozen, head_losses, kept_index, row_agreement, unrolled
from adaspec.draft.head_model import DraftHead, TokenHead
from adaspec.errors import InputError

log = logging.getLogger("adaspec.online")


@dataclass
class HeadLearnConfig:
    lr: float = 5e-5  # AdamW's (the offline training's peak is 1e-3)
    steps: int = 1  # passes over each new request
    replay: int = 1  # earlier requests trained beside each new one
    buffer: int = 256  # requests kept for replay
    depth: int = 2  # draft steps the loss unrolls, as in training
    min_tokens: int = 8  # shorter requests teach nothing worth a step
    max_tokens: int = 512  # a longer request's last positions only
    features: str = "final"
    feature_weight: float = 1.0
    bf16: bool = True  # autocast the products to bf16 (AMX / AVX-512 bf16: about 3x)
    seed: int = 0
    # the kept tokens grow by up to `grow` of the tokens the target chose outside them, each
    # once it chose it `grow_min` times (0: the shipped set stays; `KeptGrowth`)
    grow: int = 0
    grow_min: int = 3

    def __post_init__(self) -> None:
        if not self.lr > 0 or self.steps < 1 or self.replay < 0 or self.buffer < 1 \
                or self.depth < 1 or self.grow < 0 or self.grow_min < 1:
            raise InputError("head learning needs lr > 0, steps >= 1, replay >= 0, "
                             "buffer >= 1, depth >= 1, grow >= 0 and grow_min >= 1")


# the target's output rows [n, H] of token ids [n]
RowSource = Callable[[torch.Tensor], torch.Tensor]


class KeptGrowth:
    """The head's kept tokens following what it serves. The head drafts from the target's
    output rows of a fixed set of frequent tokens (FR-Spec's cut, chosen on its training
    text), so a token outside it is never drafted and never learned: a third of the target's
    tokens in German answers and half in French ones lie outside the shipped set. Tokens
    the target chose outside the set are counted over the requests learned from; one chosen
    `grow_min` times joins it (its row read from the target), up to `grow` tokens. The head's
    own weights do not depend on the set: the learned rows of `fc` and its layer stay."""

    def __init__(self, frozen: Frozen, rows: RowSource | None, budget: int,
                 min_count: int) -> None:
        """budget 0: the set stays (rows may then be None)."""
        if budget and rows is None:
            raise InputError("growing the head's kept tokens needs the target's output rows")
        self.frozen = frozen
        self.rows = rows
        self.budget = budget
        self.min_count = min_count
        self.shipped = len(frozen.token_head.token_ids)
        self.counts: Counter[int] = Counter()

    @property
    def added(self) -> int:
        return len(self.frozen.token_head.token_ids) - self.shipped

    def count(self, row: dict) -> None:
        """Counts the target's choices in `row` outside the kept set; those chosen often
        enough join it (`self.frozen` is then a new set's)."""
        if self.added >= self.budget:
            return
        chosen = row["top_ids"][:, 0].long()
        known = row["top_probs"][:, 0] > 0
        outside = chosen[known & (self.frozen.index[chosen] < 0)]
        self.counts.update(outside.tolist())
        ready = [t for t, c in self.counts.most_common() if c >= self.min_count]
        ready = ready[: self.budget - self.added]
        if not ready:
            return
        for t in ready:
            del self.counts[t]
        assert self.rows is not None  # a budget needs them (__init__)
        self.frozen = grown(self.frozen, torch.tensor(ready, dtype=torch.long), self.rows)


def grown(frozen: Frozen, new: torch.Tensor, rows: RowSource) -> Frozen:
    """`frozen` with the tokens `new` [n] (outside its kept set) kept too, their output rows
    read by `rows`; the kept ids stay sorted."""
    old = frozen.token_head
    ids = torch.cat([old.token_ids, new])
    weight = torch.cat([old.proj.weight.detach(), rows(new).to(old.proj.weight.dtype)])
    order = torch.argsort(ids)
    tokens = TokenHead(weight[order].contiguous(), ids[order], old.vocab).eval()
    return Frozen(frozen.embed, tokens, kept_index(tokens.token_ids, old.vocab))


class HeadRecorder:
    """A request's step hook: at every verification the target's states of the root and
    the accepted nodes, and its distribution there as top-k; `take` makes the row."""

    def __init__(self, top_k: int = 8) -> None:
        self.top_k = top_k
        self.begin([])

    def begin(self, prompt_ids: list[int]) -> None:
        self._prompt = list(prompt_ids)
        self._start: int | None = None  # the first recorded position
        self._features: list[torch.Tensor] = []
        self._ids: list[torch.Tensor] = []
        self._probs: list[torch.Tensor] = []

    def step(self, root: int, depth: int, path: list[int], target_logits: torch.Tensor,
             features: torch.Tensor | None = None) -> None:
        if features is None:
            return  # a runtime without features: nothing to learn from
        recorded = sum(len(f) for f in self._features)
        if self._start is None:
            self._start = root
        elif root != self._start + recorded:
            return  # a gap (a rolled-back or skipped position): keep the prefix
        rows = target_logits[[0, *path]].float()
        probs, ids = torch.softmax(rows, -1).topk(min(self.top_k, rows.shape[-1]), -1)
        self._features.append(features.detach().float().cpu())
        self._ids.append(ids.cpu())
        self._probs.append(probs.cpu())

    def take(self, generated: list[int], domain: str = "default", drafted: int = 0,
             accepted: int = 0) -> dict | None:
        """The finished request as a training row (None: nothing recorded); position p's
        label is the target's distribution of token p + 1."""
        tokens = self._prompt + list(generated)
        start = self._start
        row = None
        if start is not None and self._features:
            final = torch.cat(self._features)
            n = min(len(final), len(tokens) - start)
            row = {"tokens": torch.tensor(tokens[start : start + n], dtype=torch.long),
                   "final": final[:n], "top_ids": torch.cat(self._ids)[:n],
                   "top_probs": torch.cat(self._probs)[:n],
                   "prompt_len": max(0, len(self._prompt) - start), "domain": domain}
        self.begin([])
        return row


class HeadLearner:
    """Trains a float copy of a draft head on served requests (`online/head_service.py`
    publishes it)."""

    def __init__(self, head: DraftHead, frozen: Frozen, cfg: HeadLearnConfig | None = None,
                 rows: RowSource | None = None) -> None:
        """rows: the target's output rows by token id (needed where `cfg.grow` > 0)."""
        self.cfg = cfg or HeadLearnConfig()
        self.growth = KeptGrowth(frozen, rows, self.cfg.grow, self.cfg.grow_min)
        self.student = copy.deepcopy(head).float().train()
        for p in self.student.parameters():
            p.requires_grad_(True)
        self.opt = torch.optim.AdamW(self.student.parameters(), lr=self.cfg.lr,
                                     weight_decay=0.0)
        self.buffer: deque[dict] = deque(maxlen=self.cfg.buffer)
        self.random = random.Random(self.cfg.seed)
        self.steps = 0  # optimizer steps taken
        self.learned = 0  # requests learned from

    @property
    def frozen(self) -> Frozen:
        """The target's parts the head reads, its kept tokens as they stand."""
        return self.growth.frozen

    def keep(self, token_ids: torch.Tensor) -> None:
        """Keep `token_ids` [n] too (a saved learned head's set, read back at a start):
        those outside the set join it, within the growth budget."""
        growth = self.growth
        new = token_ids[self.frozen.index[token_ids] < 0]
        if not len(new):
            return
        if len(new) > growth.budget - growth.added or growth.rows is None:
            raise InputError(f"the saved head keeps {len(new)} tokens beyond the shipped "
                             "set, more than growing allows (--osd-head-grow)")
        growth.frozen = grown(growth.frozen, new, growth.rows)

    def learn(self, row: dict) -> float | None:
        """A few optimizer steps on `row` (and `replay` earlier rows); the mean loss, or
        None where the row is too short to teach."""
        cfg = self.cfg
        n = len(row["tokens"])
        if n < cfg.min_tokens:
            return None
        if n > cfg.max_tokens:
            row = {k: v[n - cfg.max_tokens:] if torch.is_tensor(v) else v
                   for k, v in row.items()}
            row["prompt_len"] = max(0, int(row["prompt_len"]) - (n - cfg.max_tokens))
        self.growth.count(row)
        earlier = self.random.sample(list(self.buffer), min(cfg.replay, len(self.buffer)))
        total = 0.0
        count = 0
        for _ in range(cfg.steps):
            for r in (row, *earlier):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                    outs = unrolled(self.student, self.frozen, r, cfg, cfg.depth)
                    loss, _ = head_losses(self.frozen, r, outs, cfg)
                self.opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.student.parameters(), 0.5)
                self.opt.step()
                self.steps += 1
                total += float(loss.detach())
                count += 1
        self.buffer.append(row)
        self.learned += 1
        return total / count

    def agreement(self, row: dict, depth: int = 1, head: DraftHead | None = None,
                  frozen: Frozen | None = None) -> list[tuple[int, int]]:
        """Per depth, (answer positions where the head's top token is the target's top
        token, answer positions): how the student (or `head`, with the kept tokens of
        `frozen`) as it stands would have drafted `row`."""
        return row_agreement(self.student if head is None else head, frozen or self.frozen,
                             row, self.cfg, depth)
