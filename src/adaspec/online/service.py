"""Online distillation beside an engine: records each request, buffers it under its domain,
asks the worker for an update every `interval` requests of a domain, and swaps accepted
drafts in between requests.

Everything here runs on the thread that decodes (the server's worker thread, or the
simulator), before and after a request, never during one: a swap cannot meet a half-served
request, and an adapter is loaded whole and checked before it replaces anything.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from adaspec.backends.weights import FASTEST
from adaspec.errors import InputError
from adaspec.online.adapters import Adapter, adapters_root, load_adapter
from adaspec.online.buffer import DomainBuffers
from adaspec.online.distill import DistillConfig
from adaspec.online.domains import DOMAIN_SOURCES, DomainChooser
from adaspec.online.record import RECORD_MODES, Recorder, RequestRecord
from adaspec.online.student import apply_to_serving, trainable_names
from adaspec.online.worker import (
    InlineWorker,
    ProcessWorker,
    UpdateRequest,
    UpdateResult,
    WorkerSettings,
)

log = logging.getLogger("adaspec.online")


@dataclass(frozen=True)
class OnlineConfig:
    interval: int = 16  # a domain's requests between updates
    positions: int = 0  # ... or as soon as this many new positions are buffered (0: off)
    buffer: int = 4096  # recorded positions kept per domain
    top_k: int = 32  # target probabilities kept per position
    record: str = "rejected"  # rejected | all
    layers: int = 2  # trained last layers of the draft
    domains: str = "shared"  # shared | field | classifier
    probe_every: int = 4  # every n-th request of a domain joins its probe set instead
    probe: int = 8  # probe requests kept per domain
    tolerance: float = 0.0
    distill: DistillConfig = field(default_factory=DistillConfig)
    root: str = ""  # adapters folder ("": $ADASPEC_HOME/osd/<draft>-last<layers>)
    save: bool = True
    nice: int = 19  # the worker process's nice value (0: the same priority as serving)
    head_lr: float = 3e-4  # the draft head's learning rate, where the head learns
    head_grow: int = 2048  # tokens the head's kept set may gain from its traffic (0: none)
    # while a domain's publications are refused with its learned head no better than the
    # shipped one, it learns from one request in 2, then 4, ... up to one in head_backoff
    # (1: every request)
    head_backoff: int = 4

    def __post_init__(self) -> None:
        if self.record not in RECORD_MODES:
            raise InputError(f"record must be one of {RECORD_MODES}, got {self.record!r}")
        if self.domains not in DOMAIN_SOURCES:
            raise InputError(f"domains must be one of {DOMAIN_SOURCES}, got {self.domains!r}")
        if not self.head_lr > 0:
            raise InputError(f"head_lr must be > 0, got {self.head_lr}")
        if self.head_grow < 0:
            raise InputError(f"head_grow must be >= 0 (0: the shipped set), got "
                             f"{self.head_grow}")
        if self.positions < 0:
            raise InputError(f"positions must be >= 0 (0: off), got {self.positions}")
        for name in ("interval", "buffer", "top_k", "layers", "probe_every", "probe",
                     "head_backoff"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")


def serving_state(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The float tensors of a serving draft that an adapter replaces (its starting point)."""
    params = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for name in names:
        if name in params:
            state[name] = params[name].detach().float().clone()
            continue
        layer = model.get_submodule(name.rpartition(".")[0])
        dense = getattr(layer, "dense", None)
        if dense is None:
            raise InputError(f"the draft's {getattr(layer, 'mode', '?')} layers keep no float "
                             "weights to start from: serve the draft with --draft-weights none, "
                             "int8 or int4 for online distillation")
        state[name] = dense.detach().float().clone()
    return state


class OnlineDistiller:
    def __init__(self, cfg: OnlineConfig, draft_model: nn.Module, draft_name: str,
                 target_name: str = "", target_weights: str = FASTEST,
                 in_process: bool = False, wait: bool = False, student=None) -> None:
        """`draft_model` is the serving draft (changed in place by swaps). `wait`: each
        update finishes before the next request (deterministic; the simulator's default)."""
        self.cfg = cfg
        self.model = draft_model
        self.wait = wait
        self.names = trainable_names(draft_model, cfg.layers)
        self.base = serving_state(draft_model, self.names)
        self.root = Path(cfg.root) if cfg.root else adapters_root(draft_name, cfg.layers)
        self._names = (draft_name, target_name, target_weights)
        settings = self.worker_settings(cfg)
        self.worker = (InlineWorker(settings, student) if in_process
                       else ProcessWorker(settings))
        self.adapters: dict[str, Adapter] = {}
        if cfg.save:
            from adaspec.online.adapters import load_all

            self.adapters = load_all(self.root)
        self.buffers = DomainBuffers(cfg.buffer)
        self.probes: dict[str, deque[RequestRecord]] = {}
        self.seen: dict[str, int] = {}
        self.chooser = DomainChooser(cfg.domains)
        self.recorder = Recorder(cfg.top_k, cfg.record)
        self.applied: tuple[str, int] | None = None  # (domain, step) the serving draft holds
        self.history: list[UpdateResult] = []
        self._lock = threading.Lock()  # status() is read from the server's event loop

    def worker_settings(self, cfg: OnlineConfig) -> WorkerSettings:
        """The update worker's settings: it trains on the serving draft's device."""
        draft, target, weights = self._names
        device = next(self.model.parameters()).device.type
        return WorkerSettings(draft, cfg.layers, cfg.distill, str(self.root), target, weights,
                              cfg.top_k, cfg.tolerance, save=cfg.save, nice=cfg.nice,
                              device=device)

    # ------------------------------------------------------------ the engine

    def check_engine(self, engine) -> None:
        """InputError unless `engine` drafts with the draft model distilled here."""
        drafter = getattr(engine, "drafter", None)
        backend = getattr(drafter, "backend", None)
        if getattr(backend, "model", None) is not self.model:
            raise InputError("online distillation needs the default method to draft with the "
                             "torch draft model (for example --method draft:k=3 with "
                             "--draft-weights int8)")

    def new_recorder(self) -> Recorder:
        """A recorder for one more slot of a server."""
        return Recorder(self.cfg.top_k, self.cfg.record)

    # ------------------------------------------------------------ per request
    def domain(self, requested: str | None, prompt_ids: list[int]) -> str:
        return self.chooser.choose(requested, prompt_ids)

    def prepare(self, engine: Any, domain: str) -> None:
        """Nothing per engine: `before_request` switches the shared draft."""

    def before_request(self, domain: str) -> None:
        """Collect finished updates, then give the serving draft this domain's tensors."""
        self.collect()
        adapter = self.adapters.get(domain)
        key = (domain, adapter.step) if adapter else ("", 0)
        if self.applied != key:
            apply_to_serving(self.model, adapter.state if adapter else self.base)
            self.applied = key

    def after_request(self, record: RequestRecord) -> None:
        domain = record.domain
        n = self.seen[domain] = self.seen.get(domain, 0) + 1
        if n % self.cfg.probe_every == 0:
            self.probes.setdefault(domain, deque(maxlen=self.cfg.probe)).append(record)
        else:
            self.buffers[domain].add(record)
        buf = self.buffers[domain]
        due = buf.added_since_update >= self.cfg.interval or (
            self.cfg.positions > 0 and buf.positions_since_update >= self.cfg.positions)
        if due and buf.positions and self.probes.get(domain) and not self.worker.busy:
            buf.started_update()
            self.worker.submit(UpdateRequest(domain, buf.records(), list(self.probes[domain])))
            if self.wait:
                self.collect(wait=True)

    def collect(self, wait: bool = False) -> list[UpdateResult]:
        """Take the worker's finished updates; accepted ones replace their domain's draft
        (swapped in at that domain's next request)."""
        done = self.worker.results(wait=wait)
        for result in done:
            with self._lock:
                self.history.append(result)
            if not result.accepted:
                log.info("online update of %s rejected: %s", result.domain, result.reason)
                continue
            try:
                if result.state is not None:
                    adapter = Adapter(result.domain, result.step, result.updates,
                                      result.state, {})
                else:
                    adapter = load_adapter(Path(result.manifest).parent)
            except InputError as exc:  # a torn or changed file: keep the last good draft
                log.warning("online update of %s not loaded: %s", result.domain, exc)
                continue
            with self._lock:
                self.adapters[result.domain] = adapter
        return done

    def reset(self, cfg: OnlineConfig | None = None) -> None:
        """Back to the base draft with empty buffers (a new simulation run), optionally with
        other settings (the same draft and trained layers)."""
        if cfg is not None:
            if cfg.layers != self.cfg.layers:
                raise InputError("a reset keeps the trained layers")
            self.cfg = cfg
            self.recorder = Recorder(cfg.top_k, cfg.record)
        self.worker.reset(self.worker_settings(self.cfg))
        self.adapters.clear()
        self.buffers = DomainBuffers(self.cfg.buffer)
        self.probes.clear()
        self.seen.clear()
        self.history.clear()
        self.chooser = DomainChooser(self.cfg.domains)
        apply_to_serving(self.model, self.base)
        self.applied = ("", 0)

    def close(self) -> None:
        self.worker.close()

    def status(self) -> dict:
        with self._lock:
            return self._status()

    def _status(self) -> dict:
        return {
            "domains": {d: {"step": a.step, "updates": a.updates}
                        for d, a in self.adapters.items()},
            "updates": sum(r.accepted for r in self.history),
            "rejected": sum(not r.accepted for r in self.history),
            "buffered_positions": {d: b.positions
                                   for d, b in list(self.buffers.buffers.items())},
        }
