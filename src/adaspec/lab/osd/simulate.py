"""`adaspec osd simulate`: a stream of requests replayed through online distillation (the
service, buffers, worker, guard and swaps that `adaspec serve --online-distill` runs),
without HTTP.

Two replays: `teacher-forced` (default) computes each greedy chain from one batched draft
forward over the target's output (lab/osd/replay.py: the same counts as decoding), so many
runs fit in one sitting; `engine` decodes every request with the real engine and checks that
the output stays the target's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from adaspec.errors import InputError
from adaspec.lab.osd.replay import chain_steps, replay_record, target_topk
from adaspec.lab.osd.stream import StreamRequest
from adaspec.online.record import RequestRecord
from adaspec.online.service import OnlineConfig, OnlineDistiller
from adaspec.online.worker import UpdateRequest

KINDS = ("frozen", "online", "offline")
ONLINE_KEYS = {"loss": str, "sampling": str, "domains": str, "interval": int, "steps": int,
               "lr": float, "record": str}


@dataclass(frozen=True)
class RunSpec:
    """`frozen`, `online[:key=value,...]` or `offline:FRACTION` (distil once on the first
    fraction of the stream, every position, then serve the stream frozen)."""

    text: str
    kind: str
    settings: dict = field(default_factory=dict)
    fraction: float = 1.0


def parse_run(text: str) -> RunSpec:
    kind, _, rest = text.strip().partition(":")
    if kind not in KINDS:
        raise InputError(f"run {text!r}: start with one of {KINDS}")
    if kind == "offline":
        try:
            fraction = float(rest or 1)
        except ValueError:
            raise InputError(f"run {text!r}: offline takes a fraction, e.g. offline:0.1") from None
        if not 0 < fraction <= 1:
            raise InputError(f"run {text!r}: the fraction must be in (0, 1]")
        return RunSpec(text, kind, {}, fraction)
    settings: dict = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq or key not in ONLINE_KEYS or kind == "frozen":
            raise InputError(f"run {text!r}: {part!r} is not a setting "
                             f"(online takes {', '.join(ONLINE_KEYS)})")
        try:
            settings[key] = ONLINE_KEYS[key](value)
        except ValueError:
            raise InputError(f"run {text!r}: {key} must be a {ONLINE_KEYS[key].__name__}") from None
    return RunSpec(text, kind, settings)


def run_config(base: OnlineConfig, spec: RunSpec) -> OnlineConfig:
    s = spec.settings
    distill = replace(base.distill, **{k: s[k] for k in ("loss", "sampling", "steps", "lr")
                                       if k in s})
    return replace(base, distill=distill,
                   **{k: s[k] for k in ("domains", "interval", "record") if k in s})


@dataclass
class RequestResult:
    index: int
    suite: str
    domain: str
    drafted: int
    accepted: int
    steps: int
    updates: int  # accepted updates of this request's domain before it
    seconds: float = 0.0  # engine replay: decode wall time
    tokens: int = 0
    exact: bool | None = None  # engine replay: the output is the target's
    divergence: str = ""  # engine replay, not exact: "tie" (the runtime's noise) or "bug"


@dataclass
class RunResult:
    spec: str
    requests: list[RequestResult]
    updates: list[dict]
    seconds: float
    guesses: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def acceptance(self) -> float:
        d = sum(r.drafted for r in self.requests)
        return sum(r.accepted for r in self.requests) / d if d else float("nan")


class TargetCache:
    """The target's top-k at every output index of every stream request, computed once
    (teacher-forced) and kept in a file beside the results."""

    def __init__(self, path: Path, top_k: int) -> None:
        self.path = path
        self.top_k = top_k
        self.rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if path.is_file():
            saved = torch.load(path, weights_only=True)
            if saved.get("top_k") == top_k:
                self.rows = {k: (v[0], v[1]) for k, v in saved["rows"].items()}

    def fill(self, stream: list[StreamRequest], backend, progress: bool = True) -> None:
        from tqdm import tqdm

        todo = [r for r in stream if r.prompt_id not in self.rows]
        for i, r in enumerate(tqdm(todo, desc="target distributions", disable=not progress)):
            self.rows[r.prompt_id] = target_topk(backend, r.prompt_ids, r.output, self.top_k)
            if (i + 1) % 25 == 0 or i + 1 == len(todo):
                self.save()

    def save(self) -> None:
        from adaspec.store.atomic import atomic_path

        with atomic_path(self.path) as tmp:
            torch.save({"top_k": self.top_k,
                        "rows": {k: [a, b] for k, (a, b) in self.rows.items()}}, tmp)

    def __getitem__(self, prompt_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows[prompt_id]


class TeacherForcedReplay:
    """Replays runs over one stream with one student (the serving draft, in this process)
    and one online-distillation service whose worker is reset between runs."""

    def __init__(self, stream: list[StreamRequest], student, service: OnlineDistiller,
                 targets: TargetCache, k: int, max_new_tokens: int, label_every: int = 4,
                 offline_steps: int = 160, progress: bool = True) -> None:
        self.stream = stream
        self.student = student
        self.service = service
        self.targets = targets
        self.k = k
        self.max_new = max_new_tokens
        self.label_every = label_every
        self.offline_steps = offline_steps
        self.progress = progress
        self.base_cfg = service.cfg

    def _requested(self, cfg: OnlineConfig, r: StreamRequest) -> str | None:
        if cfg.domains == "field":
            return r.suite
        if cfg.domains == "classifier":  # only some requests name their domain
            return r.suite if r.index % self.label_every == 0 else None
        return None

    def run(self, spec: RunSpec) -> RunResult:
        from tqdm import tqdm

        cfg = run_config(self.base_cfg, spec)
        svc = self.service
        svc.reset(cfg)
        t0 = time.perf_counter()
        updates: list[dict] = []
        if spec.kind == "offline":
            updates.append(self._offline(cfg, spec.fraction))
        results: list[RequestResult] = []
        guesses: list[list[int]] = []
        bar = tqdm(self.stream, desc=spec.text, disable=not self.progress, unit="req")
        for r in bar:
            domain = svc.domain(self._requested(cfg, r), r.prompt_ids) \
                if spec.kind == "online" else "default"
            if spec.kind == "online":
                svc.before_request(domain)
            guess = self.student.predictions(r.tokens, len(r.prompt_ids)).tolist()
            rep = chain_steps(guess, r.output, self.k, self.max_new, cfg.record)
            done = svc.adapters.get(domain)
            results.append(RequestResult(r.index, r.suite, domain, rep.drafted, rep.accepted,
                                         len(rep.steps), done.updates if done else 0))
            guesses.append(guess)
            if spec.kind == "online":
                ids, probs = self.targets[r.prompt_id]
                svc.after_request(replay_record(r.prompt_ids, r.output, rep, ids, probs,
                                                domain))
            if len(results) % 10 == 0:
                last = results[-50:]
                d = sum(x.drafted for x in last)
                bar.set_postfix(acc=f"{sum(x.accepted for x in last) / max(d, 1):.3f}")
        if spec.kind == "online":
            svc.collect(wait=True)
            updates = [_update_row(u) for u in svc.history]
        return RunResult(spec.text, results, updates, time.perf_counter() - t0, guesses)

    def _offline(self, cfg: OnlineConfig, fraction: float) -> dict:
        """Distil once on the first `fraction` of the stream, every output position."""
        n = max(1, round(len(self.stream) * fraction))
        records: list[RequestRecord] = []
        for r in self.stream[:n]:
            ids, probs = self.targets[r.prompt_id]
            p = len(r.prompt_ids)
            rows = list(range(1, len(r.output)))  # the first token is the prefill's
            records.append(RequestRecord(r.tokens, p, [p + i for i in rows],
                                         ids[rows].long(), probs[rows].float()))
        svc = self.service
        offline = replace(cfg, distill=replace(cfg.distill, steps=self.offline_steps))
        svc.reset(offline)
        svc.worker.submit(UpdateRequest("default", records, []))
        svc.collect(wait=True)
        row = _update_row(svc.history[-1]) if svc.history else {"accepted": False}
        row["requests"] = n
        svc.before_request("default")  # the offline draft serves the whole stream
        return row


def _update_row(u) -> dict:
    return {"domain": u.domain, "accepted": u.accepted, "reason": u.reason, "step": u.step,
            "probe_before": u.before, "probe_after": u.after, "loss_first": u.loss_first,
            "loss_last": u.loss_last, "seconds": round(u.seconds, 3),
            "cpu_seconds": round(u.cpu_seconds, 3)}
