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
(replay, against forgetting). `OnlineHead` is the server's side (`adaspec serve
--online-distill` where the default method drafts with the head): requests are learned from
in a background thread at the lowest priority, and every `interval` requests the learned
head, if a probe of the latest requests finds it no worse than the serving one, is published
(engines built from then on draft with it; `draft/head.py` `replace_head`) and saved
atomically (read back at the next start).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import queue
import random
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adaspec.draft.head_loss import Frozen, head_losses, kept_index, row_agreement, unrolled
from adaspec.draft.head_model import DraftHead
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

    def __post_init__(self) -> None:
        if not self.lr > 0 or self.steps < 1 or self.replay < 0 or self.buffer < 1 \
                or self.depth < 1:
            raise InputError("head learning needs lr > 0, steps >= 1, replay >= 0, "
                             "buffer >= 1 and depth >= 1")


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
    """Trains a float copy of a draft head on served requests; `publish` hands it over."""

    def __init__(self, head: DraftHead, frozen: Frozen,
                 cfg: HeadLearnConfig | None = None) -> None:
        self.cfg = cfg or HeadLearnConfig()
        self.frozen = frozen
        self.student = copy.deepcopy(head).float().train()
        for p in self.student.parameters():
            p.requires_grad_(True)
        self.opt = torch.optim.AdamW(self.student.parameters(), lr=self.cfg.lr,
                                     weight_decay=0.0)
        self.buffer: deque[dict] = deque(maxlen=self.cfg.buffer)
        self.random = random.Random(self.cfg.seed)
        self.steps = 0  # optimizer steps taken
        self.learned = 0  # requests learned from

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

    def agreement(self, row: dict, depth: int = 1,
                  head: DraftHead | None = None) -> list[tuple[int, int]]:
        """Per depth, (answer positions where the head's top token is the target's top
        token, answer positions): how the student (or `head`) as it stands would have
        drafted `row`."""
        return row_agreement(self.student if head is None else head, self.frozen, row,
                             self.cfg, depth)


class OnlineHead:
    """Online learning of the default method's draft head while serving (the server's
    `--online-distill` where that method drafts with the head): `OnlineDistiller`'s
    interface, one domain."""

    def __init__(self, cfg: Any, drafter: Any, target: Any, name: str) -> None:
        """cfg: the server's `OnlineConfig` (interval: requests between publications;
        head_lr; top_k; nice; root; save; probe; tolerance); drafter: the default engine's
        head drafter (`draft/head.py`, loaded from an artifact)."""
        from adaspec.draft.head_artifact import load_for_target

        if cfg.domains != "shared":
            raise InputError("online learning of the draft head keeps one head: "
                             "--osd-domains shared")
        if getattr(drafter, "origin", None) is None:
            raise InputError("online learning of the draft head needs the head loaded "
                             "from its file (--method head or auto:use=...+head)")
        self.cfg = cfg
        path, self.weights = drafter.origin
        self.target_name = name
        self.serving: DraftHead = drafter.head
        head, tokens, embed = load_for_target(path, target, torch.float32)
        frozen = Frozen(embed, tokens, kept_index(tokens.token_ids, tokens.vocab))
        self.rows = tokens.proj.weight.detach()  # the output rows a ggml head is exported with
        self.learner = HeadLearner(head, frozen, HeadLearnConfig(lr=cfg.head_lr))
        self.published_float = copy.deepcopy(self.learner.student).eval()
        self.file = (Path(cfg.root) if cfg.root else _heads_root()) / f"{name}-online.pt"
        self.token_ids = tokens.token_ids
        self.recorder = HeadRecorder(min(cfg.top_k, 8))
        self._queue: queue.Queue[dict | None] = queue.Queue(maxsize=64)
        self._lock = threading.Lock()
        self.seen = self.learned = self.published = self.rejected = self.dropped = 0
        self._probe: deque[tuple[int, int, int]] = deque(maxlen=max(1, cfg.probe) * 4)
        self._since = 0
        if cfg.save and self.file.is_file():
            self._resume()
        self._thread = threading.Thread(target=self._run, name="adaspec-head-learner",
                                        daemon=True)
        self._thread.start()

    def new_recorder(self) -> HeadRecorder:
        return HeadRecorder(self.recorder.top_k)

    def check_engine(self, engine: Any) -> None:
        """InputError unless `engine` drafts with the head learned here."""
        if head_drafter(engine) is None:
            raise InputError("online learning of the draft head needs the default method to "
                             "draft with it (--method head or auto:use=...+head)")

    def domain(self, requested: str | None, prompt_ids: list[int]) -> str:
        return "default"

    def before_request(self, domain: str) -> None:
        """Nothing to swap: publication replaces the head engines are built with."""

    def after_request(self, record: dict | None) -> None:
        if record is None:
            return
        self.seen += 1
        try:
            self._queue.put_nowait(record)
        except queue.Full:  # learning lags serving: the newest requests wait, the rest go
            self.dropped += 1

    def collect(self, wait: bool = False) -> list:
        if wait:
            self._queue.join()
        return []

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def status(self) -> dict:
        with self._lock:
            probe = list(self._probe)
        pos = sum(n for _, _, n in probe)
        return {"kind": "draft head", "requests": self.seen, "learned": self.learned,
                "dropped": self.dropped, "steps": self.learner.steps,
                "published": self.published, "rejected": self.rejected,
                "probe_agreement": {
                    "learned": round(sum(a for a, _, _ in probe) / pos, 4) if pos else None,
                    "serving": round(sum(b for _, b, _ in probe) / pos, 4) if pos else None,
                    "positions": pos},
                "file": str(self.file)}

    # ------------------------------------------------------------ the learner's thread
    def _run(self) -> None:
        # the lowest priority: learning takes what serving leaves (the threads it starts for
        # its products inherit it)
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.cfg.nice)
        while True:
            row = self._queue.get()
            try:
                if row is None:
                    return
                self._learn(row)
            except Exception:  # learning never stops serving
                log.exception("online learning of the draft head failed on a request")
            finally:
                self._queue.task_done()

    def _learn(self, row: dict) -> None:
        learner = self.learner
        # the probe: how the learned head and the serving one draft this request, before
        # either learned from it
        mine = learner.agreement(row)[0]
        theirs = learner.agreement(row, head=self.published_float)[0][0]
        with self._lock:
            self._probe.append((mine[0], theirs, mine[1]))
        if learner.learn(row) is None:
            return
        self.learned += 1
        self._since += 1
        if self._since >= self.cfg.interval:
            self._since = 0
            self._publish()

    def _publish(self) -> None:
        """The learned head replaces the serving one, unless the probe (the latest
        requests, each scored by both before either learned from it) finds it worse."""
        with self._lock:
            probe = list(self._probe)
        mine = sum(a for a, _, _ in probe)
        theirs = sum(b for _, b, _ in probe)
        if mine + self.cfg.tolerance * sum(n for _, _, n in probe) < theirs:
            self.rejected += 1
            log.info("online head not published: the probe agreed %d times against the "
                     "serving head's %d", mine, theirs)
            return
        student = self._publish_now()
        with self._lock:
            self._probe.clear()
        self.published += 1
        if self.cfg.save:
            self._save(student)

    def _publish_now(self) -> DraftHead:
        from adaspec.draft.head import replace_head, serving_head

        student = copy.deepcopy(self.learner.student).eval()
        new = serving_head(copy.deepcopy(student), self.weights)
        if self.weights == "ggml":  # its layer exported and loaded before engines take it
            from adaspec.draft.head_ggml import attach

            attach(new, self.rows, self.target_name)
        replace_head(self.serving, new)
        self.serving, self.published_float = new, student
        return student

    def _save(self, student: DraftHead) -> None:
        from adaspec.draft import head_artifact

        head_artifact.save(self.file, student, self.token_ids, {
            "what": "a draft head learned online while serving (adaspec serve "
                    "--online-distill)", "published": self.published,
            "learned_requests": self.learned, "optimizer_steps": self.learner.steps})

    def _resume(self) -> None:
        from adaspec.draft import head_artifact

        try:
            art = head_artifact.load(self.file)
            self.learner.student.load_state_dict({k: v.float() for k, v in art.state.items()})
        except (InputError, RuntimeError, KeyError) as exc:
            log.warning("online head at %s not resumed: %s", self.file, exc)
            return
        self._publish_now()


def head_drafter(engine: Any) -> Any:
    """The draft head drafter `engine` drafts with (the head method's, or auto's head
    source); None for other drafters."""
    drafter = getattr(engine, "drafter", None)
    if getattr(drafter, "name", None) == "head":
        return drafter
    return getattr(drafter, "head", None)


def _heads_root() -> Path:
    from adaspec.store.assembly import adaspec_home

    return adaspec_home() / "heads"
