"""The update worker: holds the student (a float copy of the draft), runs distillation
updates on request, guards them and saves the accepted ones. `ProcessWorker` runs it in a
child process so serving goes on with the current draft meanwhile; `InlineWorker` runs the
same code in this process (the simulator's deterministic mode, and tests)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from adaspec.backends.weights import FASTEST
from adaspec.errors import AdaspecError, InputError
from adaspec.online.adapters import Adapter, load_all, save_adapter
from adaspec.online.distill import DistillConfig, TargetScorer, agreement, distill
from adaspec.online.record import RequestRecord, compact
from adaspec.online.student import Student

log = logging.getLogger("adaspec.online")


@dataclass(frozen=True)
class WorkerSettings:
    draft: str  # the draft model (a built-in name or a model directory)
    layers: int  # trained last layers
    distill: DistillConfig
    root: str  # where adapters are saved
    target: str = ""  # the target model, loaded only for student sampling
    target_weights: str = FASTEST  # the target's weights there (backends/weights.py)
    top_k: int = 32
    tolerance: float = 0.0  # the guard accepts a probe agreement down by at most this
    threads: int = 0  # torch threads (0: leave torch's default)
    # the worker process's nice value: at 19 it runs on CPU time serving leaves idle (on 2
    # cores an update at equal priority slowed decoding 2.6x; docs/osd.md)
    nice: int = 19
    save: bool = True  # False: keep accepted adapters in memory only (ablation runs)
    # where the student trains: the serving draft's device (a GPU's spare compute there)
    device: str = "cpu"


@dataclass
class UpdateRequest:
    domain: str
    records: list[RequestRecord]
    probe: list[RequestRecord]


@dataclass
class UpdateResult:
    domain: str
    accepted: bool
    reason: str  # why it was rejected ("" when accepted)
    step: int
    updates: int
    before: float  # probe agreement of the serving draft
    after: float  # ... and of the updated one
    loss_first: float = float("nan")
    loss_last: float = float("nan")
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    manifest: str = ""  # the saved adapter's manifest ("" when not saved)
    state: dict[str, torch.Tensor] | None = field(default=None, repr=False)  # when not saved


class UpdateRunner:
    """The worker's state: one student model, each domain's trained tensors and optimizer."""

    def __init__(self, settings: WorkerSettings, student: Student | None = None) -> None:
        self.settings = settings
        if settings.threads:
            torch.set_num_threads(settings.threads)
        if student is None:
            from adaspec.store.loading import load_model

            model = load_model(settings.draft, "bfloat16").model.to(settings.device)
            student = Student(model, settings.layers)
        self.student = student
        self.base = student.state()
        self.adapters: dict[str, Adapter] = {}
        if settings.save:
            self.adapters = load_all(Path(settings.root))
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.rng = random.Random(settings.distill.seed)
        self._scorer: TargetScorer | None = None

    def reset(self, settings: WorkerSettings | None = None) -> None:
        """Forget every domain's training (a new simulation run), optionally with new
        settings for the same draft; saved files stay, the boundary cache too."""
        if settings is not None:
            if (settings.draft, settings.layers) != (self.settings.draft, self.settings.layers):
                raise InputError("a reset keeps the draft and its trained layers")
            if settings.distill.sampling != "teacher" and settings.target != self.settings.target:
                self._scorer = None
            self.settings = settings
        self.adapters.clear()
        self.optimizers.clear()
        self.rng = random.Random(self.settings.distill.seed)

    def scorer(self) -> TargetScorer | None:
        if self.settings.distill.sampling == "teacher":
            return None
        if self._scorer is None:
            if not self.settings.target:
                raise InputError("student sampling needs the target model in the worker")
            self._scorer = backend_scorer(self.settings.target, self.settings.target_weights,
                                          self.settings.top_k)
        return self._scorer

    def update(self, req: UpdateRequest) -> UpdateResult:
        import time

        cpu0 = time.process_time()
        s = self.student
        current = self.adapters.get(req.domain)
        s.load_state(current.state if current else self.base)
        step = current.step if current else 0
        updates = current.updates if current else 0
        before = agreement(s, req.probe)
        opt = self.optimizers.get(req.domain)
        if opt is None:
            opt = self.optimizers[req.domain] = torch.optim.AdamW(
                s.params, lr=self.settings.distill.lr, weight_decay=0.0)
        stats = distill(s, opt, req.records, self.settings.distill, self.scorer(), self.rng)
        after = agreement(s, req.probe) if stats.finite else float("nan")
        reason = ""
        if not stats.finite:
            reason = "the update produced non-finite weights or loss"
        elif after < before - self.settings.tolerance:
            reason = f"probe agreement fell from {before:.3f} to {after:.3f}"
        result = UpdateResult(req.domain, not reason, reason, step, updates, before, after,
                              stats.loss_first, stats.loss_last, stats.seconds)
        if reason:
            # back to the last good tensors; the optimizer's moments saw the bad steps: drop
            self.optimizers.pop(req.domain, None)
            s.load_state(current.state if current else self.base)
        else:
            adapter = Adapter(req.domain, step + stats.steps, updates + 1, s.state(),
                              {"draft": self.settings.draft, "layers": self.settings.layers,
                               "loss": self.settings.distill.loss,
                               "sampling": self.settings.distill.sampling,
                               "probe_agreement": after})
            self.adapters[req.domain] = adapter
            result.step, result.updates = adapter.step, adapter.updates
            if self.settings.save:
                result.manifest = str(save_adapter(Path(self.settings.root), adapter))
            else:
                result.state = adapter.state
        result.cpu_seconds = time.process_time() - cpu0
        return result


def backend_scorer(target: str, weights: str, top_k: int) -> TargetScorer:
    """Scores token sequences with the target (its own backend in the worker)."""
    from adaspec.backends.load import load_backend

    backend, _, _ = load_backend(target, "bfloat16", weights, role="target")

    def score(tokens: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = backend.prefill(torch.tensor(tokens[:start])).logits[-1:]
        rest = tokens[start:-1]
        rows = [first]
        if rest:
            rows.append(backend.forward(torch.tensor(rest)).logits)
        return compact(torch.cat(rows), top_k)

    return score


class InlineWorker:
    """Runs updates in this process, when asked (`submit` returns after the update)."""

    def __init__(self, settings: WorkerSettings, student: Student | None = None) -> None:
        self.runner = UpdateRunner(settings, student)
        self._done: list[UpdateResult] = []

    @property
    def busy(self) -> bool:
        return False

    def submit(self, req: UpdateRequest) -> None:
        self._done.append(self.runner.update(req))

    def results(self, wait: bool = False) -> list[UpdateResult]:
        done, self._done = self._done, []
        return done

    def reset(self, settings: WorkerSettings | None = None) -> None:
        self.runner.reset(settings)

    def close(self) -> None:
        pass


def _child(conn, settings: WorkerSettings) -> None:
    if settings.nice:
        with contextlib.suppress(OSError):
            os.nice(settings.nice)
    try:
        runner = UpdateRunner(settings)
        conn.send(("ready", None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as one line
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:
            return
        if kind == "stop":
            return
        if kind == "reset":
            runner.reset(payload)
            continue
        try:
            conn.send(("result", runner.update(payload)))
        except AdaspecError as exc:
            conn.send(("error", str(exc)))
        except Exception as exc:  # noqa: BLE001 - one bad update must not end the worker
            log.exception("online update failed")
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class ProcessWorker:
    """The update runner in a child process; one update at a time."""

    def __init__(self, settings: WorkerSettings, timeout: float = 600.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child, settings), daemon=True,
                                 name="adaspec-osd-worker")
        self._proc.start()
        child.close()
        if not self._conn.poll(timeout):
            self.close()
            raise AdaspecError("the online-distillation worker did not start in time")
        try:
            kind, payload = self._conn.recv()
        except EOFError:  # the child died without a word (killed, out of memory, crashed)
            self._proc.join(5)
            kind, payload = "failed", f"it exited (exit code {self._proc.exitcode})"
        if kind != "ready":
            self.close()
            raise AdaspecError(f"the online-distillation worker failed to start: {payload}")
        self._pending = 0
        self.errors: list[str] = []

    @property
    def busy(self) -> bool:
        return self._pending > 0

    def submit(self, req: UpdateRequest) -> None:
        self._conn.send(("update", req))
        self._pending += 1

    def results(self, wait: bool = False) -> list[UpdateResult]:
        out: list[UpdateResult] = []
        while self._pending and (self._conn.poll() or wait):
            try:
                kind, payload = self._conn.recv()
            except EOFError:
                self._pending = 0
                self.errors.append("the online-distillation worker exited")
                break
            self._pending -= 1
            if kind == "result":
                out.append(payload)
            else:
                self.errors.append(str(payload))
                log.warning("online update failed: %s", payload)
        return out

    def reset(self, settings: WorkerSettings | None = None) -> None:
        self.results(wait=True)
        self._conn.send(("reset", settings))

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._conn.send(("stop", None))
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
