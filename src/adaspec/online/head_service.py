"""The server's side of online learning of the draft head (`adaspec serve --online-distill`
where the default method drafts with the head; the learning itself is `online/head.py`).

Requests are learned from in a background thread at the lowest priority; every `interval`
requests of a domain its learned head, if a probe of the latest requests finds it no worse
than the serving one, is published and saved atomically (read back at the next start). One
head for all traffic (`--osd-domains shared`): published by swapping the shared copy engines
are built with (`draft/head.py` `replace_head`). One head per domain (`field`: the request's
`domain`; `classifier`: learned from the requests that name one): each starts from the
shipped head, and a request's engine drafts with its domain's head (`prepare`), so a stream
of French translations does not teach the head that serves code.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import queue
import threading
from collections import deque
from pathlib import Path
from typing import Any

import torch

from adaspec.draft.head_artifact import rows_for_target
from adaspec.draft.head_loss import Frozen, kept_index
from adaspec.draft.head_model import DraftHead, TokenHead
from adaspec.errors import InputError
from adaspec.online.domains import DEFAULT, DomainChooser
from adaspec.online.head import HeadLearnConfig, HeadLearner, HeadRecorder

log = logging.getLogger("adaspec.online")

# domains learned at once beyond the default one (each holds a float head, its published
# copy, its optimizer state and a replay buffer: about 250 MB for the built-in head)
MAX_DOMAINS = 8
# a refused publication whose learned head agreed with the target at most this much more
# often than the shipped head (a share of the probe's positions) counts toward backing off
STALE_MARGIN = 0.01
# requests a domain's head keeps for replay (one head for all keeps HeadLearnConfig's 256:
# a 300-token request's states are 1.8 MB)
DOMAIN_BUFFER = 64


class DomainHead:
    """One domain's head as it learns, and the one published for it."""

    def __init__(self, learner: HeadLearner, file: Path, probe: int) -> None:
        self.learner = learner
        self.file = file
        self.published_float = copy.deepcopy(learner.student).eval()
        # the kept tokens the serving head drafts from (the probe scores it with them)
        self.published_frozen = learner.frozen
        self.serving: DraftHead | None = None  # in the serving format; None: the shipped
        self.tokens: TokenHead | None = None  # its kept tokens' rows; None: the shipped
        # per request: agreement of the learned head, the serving one, the shipped one;
        # positions
        self.probe: deque[tuple[int, int, int, int]] = deque(maxlen=max(1, probe) * 4)
        self.since = self.learned = self.published = self.rejected = 0
        # publications refused in a row with the learned head no better than the shipped
        # one (`_publish`): learning that gains nothing
        self.stale = 0
        self.arrived = self.skipped = 0  # requests handed to it; those it let go

    def learns_from_next(self, backoff: int) -> bool:
        """Whether the next request is learned from (and probed): every one while learning
        gains; while publications keep being refused with the learned head no better than
        the shipped one (traffic the head already knows: learning gains nothing and costs
        serving a few percent on 2 vCPUs) one in 2, 4, ... up to one in `backoff`."""
        self.arrived += 1
        every = min(2 ** min(self.stale, 16), backoff)
        if self.arrived % every:
            self.skipped += 1
            return False
        return True

    def status(self) -> dict:
        probe = list(self.probe)
        pos = sum(p[3] for p in probe)
        agree = {name: round(sum(p[i] for p in probe) / pos, 4) if pos else None
                 for i, name in enumerate(("learned", "serving", "shipped"))}
        return {"learned": self.learned, "published": self.published,
                "rejected": self.rejected, "skipped": self.skipped,
                "steps": self.learner.steps,
                "kept_added": self.learner.growth.added,
                "probe_agreement": agree | {"positions": pos},
                "file": str(self.file)}


class OnlineHead:
    """Online learning of the default method's draft head while serving:
    `OnlineDistiller`'s interface."""

    def __init__(self, cfg: Any, drafter: Any, target: Any, name: str) -> None:
        """cfg: the server's `OnlineConfig` (interval: requests between publications;
        domains; head_lr; head_grow; head_backoff; top_k; nice; root; save; probe;
        tolerance); drafter: the default engine's head drafter (`draft/head.py`, loaded
        from an artifact)."""
        from adaspec.draft.head_artifact import load_for_target

        if getattr(drafter, "origin", None) is None:
            raise InputError("online learning of the draft head needs the head loaded "
                             "from its file (--method head or auto:use=...+head)")
        self.cfg = cfg
        path, self.weights = drafter.origin
        self.target_name = name
        self.chooser = DomainChooser(cfg.domains)
        self.shared = cfg.domains == "shared"
        # what a domain starts from, and what serves it until its first publication
        self.shipped_head: DraftHead = drafter.head
        self.shipped_tokens: TokenHead = drafter.tokens
        head, tokens, embed = load_for_target(path, target, torch.float32)
        self._start = (head, Frozen(embed, tokens, kept_index(tokens.token_ids, tokens.vocab)))
        self._rows = rows_for_target(target) if cfg.head_grow else None
        self.root = Path(cfg.root) if cfg.root else _heads_root()
        self.recorder = HeadRecorder(min(cfg.top_k, 8))
        self._queue: queue.Queue[dict | None] = queue.Queue(maxsize=64)
        self._lock = threading.Lock()
        self.seen = self.dropped = 0
        self.domains: dict[str, DomainHead] = {}
        self._domain(DEFAULT)
        if cfg.save and not self.shared:  # the domains learned before this start
            for file in sorted(self.root.glob(f"{name}-online-*.pt")):
                self._domain(file.stem[len(f"{name}-online-"):])
        self._thread = threading.Thread(target=self._run, name="adaspec-head-learner",
                                        daemon=True)
        self._thread.start()

    # the default domain's (one head for all traffic: the only one)
    @property
    def learner(self) -> HeadLearner:
        return self.domains[DEFAULT].learner

    @property
    def file(self) -> Path:
        return self.domains[DEFAULT].file

    @property
    def serving(self) -> DraftHead:
        return self.domains[DEFAULT].serving or self.shipped_head

    def _domain(self, domain: str) -> DomainHead | None:
        """The domain's learning head, made (and a saved one read back) on first use; None
        past `MAX_DOMAINS`."""
        found = self.domains.get(domain)
        if found is not None or len(self.domains) > MAX_DOMAINS:
            return found
        from adaspec.online.adapters import safe_name

        head, frozen = self._start
        settings = HeadLearnConfig(lr=self.cfg.head_lr, grow=self.cfg.head_grow)
        if not self.shared:
            settings.buffer = DOMAIN_BUFFER
        learner = HeadLearner(head, frozen, settings, rows=self._rows)
        suffix = "" if domain == DEFAULT and self.shared else f"-{safe_name(domain)}"
        made = DomainHead(learner, self.root / f"{self.target_name}-online{suffix}.pt",
                          self.cfg.probe)
        with self._lock:
            self.domains[domain] = made
        if self.cfg.save and made.file.is_file():
            self._resume(made)
        return made

    def new_recorder(self) -> HeadRecorder:
        return HeadRecorder(self.recorder.top_k)

    def check_engine(self, engine: Any) -> None:
        """InputError unless `engine` drafts with the head learned here."""
        if head_drafter(engine) is None:
            raise InputError("online learning of the draft head needs the default method to "
                             "draft with it (--method head or auto:use=...+head)")

    def domain(self, requested: str | None, prompt_ids: list[int]) -> str:
        return self.chooser.choose(requested, prompt_ids)

    def before_request(self, domain: str) -> None:
        """Nothing to swap for every request at once: `prepare` sets each engine's head."""

    def prepare(self, engine: Any, domain: str) -> None:
        """`engine` (not started yet) drafts with `domain`'s published head (the shipped
        one before its first publication). One head for all: engines are built with it."""
        if self.shared:
            return
        with self._lock:
            found = self.domains.get(domain)
            head = found.serving if found is not None else None
            tokens = found.tokens if found is not None else None
        head_drafter(engine).use(head or self.shipped_head, tokens or self.shipped_tokens)

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
            domains = {name: d.status() for name, d in self.domains.items()}
        out = {"kind": "draft head", "requests": self.seen, "dropped": self.dropped,
               **{k: sum(d[k] for d in domains.values())
                  for k in ("learned", "published", "rejected", "skipped", "steps")}}
        if self.shared:
            default = domains[DEFAULT]
            return out | {"kept_added": default["kept_added"],
                          "probe_agreement": default["probe_agreement"],
                          "file": default["file"]}
        return out | {"domains": domains}

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
        domain = self._domain(str(row.get("domain") or DEFAULT))
        if domain is None:
            self.dropped += 1
            log.warning("online head: more than %d domains learn at once; %r is served by "
                        "the shipped head", MAX_DOMAINS, row.get("domain"))
            return
        if not domain.learns_from_next(self.cfg.head_backoff):
            return
        learner = domain.learner
        # the probe: how the learned head, the serving one and the shipped one draft this
        # request, before any learned from it
        mine = learner.agreement(row)[0]
        theirs = learner.agreement(row, head=domain.published_float,
                                   frozen=domain.published_frozen)[0][0]
        shipped = learner.agreement(row, head=self._start[0], frozen=self._start[1])[0][0]
        with self._lock:
            domain.probe.append((mine[0], theirs, shipped, mine[1]))
        if learner.learn(row) is None:
            return
        domain.learned += 1
        domain.since += 1
        if domain.since >= self.cfg.interval:
            domain.since = 0
            self._publish(domain)

    def _publish(self, domain: DomainHead) -> None:
        """The learned head replaces the serving one, unless the probe (the latest
        requests, each scored by all three before any learned from them) finds it worse
        than the serving head or than the shipped one: learning may drift on traffic like
        the head's training text (on 240 chat requests, -0.004 at depth 1 at 3e-4), and
        the shipped head bounds what is served."""
        with self._lock:
            probe = list(domain.probe)
        mine, theirs, shipped, positions = (sum(p[i] for p in probe) for i in range(4))
        if mine + self.cfg.tolerance * positions < max(theirs, shipped):
            domain.rejected += 1
            # nothing learned beyond the shipped head: back off; behind a learned serving
            # head but ahead of the shipped one: still learning the traffic
            gained = mine > shipped + STALE_MARGIN * positions
            domain.stale = 0 if gained else domain.stale + 1
            log.info("online head not published: the probe agreed %d times against the "
                     "serving head's %d and the shipped head's %d", mine, theirs, shipped)
            return
        student = self._publish_now(domain)
        with self._lock:
            domain.probe.clear()
        domain.published += 1
        domain.stale = 0
        if self.cfg.save:
            self._save(domain, student)

    def _publish_now(self, domain: DomainHead) -> DraftHead:
        from adaspec.draft.head import replace_head, serving_head, serving_tokens

        student = copy.deepcopy(domain.learner.student).eval()
        frozen = domain.learner.frozen
        new = serving_head(copy.deepcopy(student), self.weights)
        if self.weights == "ggml":  # its layer exported and loaded before engines take it
            from adaspec.draft.head_ggml import attach

            attach(new, frozen.token_head.proj.weight.detach(), self.target_name).prewarm()
        tokens = domain.tokens
        if frozen is not domain.published_frozen:  # the kept set grew: engines get its rows
            tokens = serving_tokens(copy.deepcopy(frozen.token_head), self.weights)
        if self.shared:  # engines built from now on draft with it
            replace_head(self.serving, new, tokens)
        with self._lock:
            domain.serving, domain.tokens = new, tokens
            domain.published_float, domain.published_frozen = student, frozen
        return student

    def _save(self, domain: DomainHead, student: DraftHead) -> None:
        from adaspec.draft import head_artifact

        head_artifact.save(domain.file, student, domain.published_frozen.token_head.token_ids, {
            "what": "a draft head learned online while serving (adaspec serve "
                    "--online-distill)", "published": domain.published,
            "learned_requests": domain.learned, "optimizer_steps": domain.learner.steps})

    def _resume(self, domain: DomainHead) -> None:
        from adaspec.draft import head_artifact

        try:
            art = head_artifact.load(domain.file)
            domain.learner.student.load_state_dict({k: v.float()
                                                    for k, v in art.state.items()})
            domain.learner.keep(art.token_ids)
        except (InputError, RuntimeError, KeyError) as exc:
            log.warning("online head at %s not resumed: %s", domain.file, exc)
            return
        self._publish_now(domain)


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
