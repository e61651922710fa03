"""The bounded FIFO queue and the one worker thread that owns a model instance, decoding up
to `max_batch` requests together.

HTTP handlers run on the event loop; decoding runs on the worker thread. A handler submits a
`Job` and reads its events (chunks, then the result or an error) from an asyncio queue the
worker fills.

Each running request has a slot: a sequence of its own in the target's (and the draft's) KV
cache and engines built on it; `engine/batch.py` runs them, one target call a round. With
`max_batch` 1 (or a runtime that keeps one sequence) the one slot is the models' own cache
and a round is one request's step: the FIFO server. Waiting requests join at round
boundaries, while a slot is free and the KV cache has room for their prompt and token budget
(else they wait); a long prompt prefills in chunks between rounds. Cancellation (the client
left) and deadlines are checked every round: the request stops there, its engine's steps are
closed, and its slot is free for the next one.

Idle slots keep their last request's tokens (`--cache-slots`) for that conversation's next
turn: a prompt takes the idle slot holding the longest start of it, else the least recently
used one, and room is made least recently used first.

With online distillation each slot records its own request (a recorder per slot, taken when
the request ends, under the request's domain). The draft's tensors are one for all slots: a
request switches them to its domain's draft only when no running request has another domain
(else it drafts with the one in use; its record still trains its domain).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from adaspec.backends.base import common_prefix
from adaspec.backends.memory import Trimmer
from adaspec.core.sampling import SamplingParams
from adaspec.engine.batch import BatchDecoder
from adaspec.engine.loop import TextGenerator
from adaspec.engine.steps import GenerationResult, StreamChunk
from adaspec.errors import AdaspecError, InputError
from adaspec.serve import errors
from adaspec.serve.instance import ModelInstance
from adaspec.serve.metrics import ServeMetrics
from adaspec.serve.pieces import TokenPieces

if TYPE_CHECKING:
    from adaspec.online.head import HeadRecorder
    from adaspec.online.record import Recorder

log = logging.getLogger("adaspec.serve")

CHUNK, DONE, ERROR = "chunk", "done", "error"
DRAFT_ROOM = 17  # KV entries a step may add beyond a request's budget (k_max + 1)
# tokens at the end of a prompt its conversation's next turn may tokenize otherwise (the
# answer's text merged with what precedes it)
BOUNDARY = 4


@dataclass
class Event:
    kind: str  # CHUNK | DONE | ERROR
    chunk: StreamChunk | None = None
    pieces: list[str] | None = None  # per token of the chunk, when the job asked for them
    result: GenerationResult | None = None
    error: errors.ServeError | None = None


class Job:
    """One request's generation: its inputs, its deadline and its event queue."""

    def __init__(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams,
                 stop: list[str], method: str, timeout: float,
                 token_sources: bool = False, stream: bool = True,
                 domain: str | None = None, cache_prompt: bool = True) -> None:
        self.id = uuid.uuid4().hex[:24]
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.stop = stop
        self.method = method
        self.token_sources = token_sources
        self.domain = domain  # the request's own domain field (online distillation)
        self.cache_prompt = cache_prompt  # False: reuse nothing a slot kept (prefill afresh)
        self.stream = stream  # False: no chunk events, only the result (less work per step)
        self.timeout = timeout
        self.arrived = time.monotonic()
        self.deadline = self.arrived + timeout
        self.started: float | None = None  # when the worker took it
        self.first_token: float | None = None
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._cancelled = threading.Event()
        self.cancel_reason = "cancelled"  # or "timeout": the metrics' outcome label

    def again(self, sampling: SamplingParams) -> Job:
        """Another answer to the same prompt (`n` > 1), drawn with `sampling`."""
        return Job(self.prompt_ids, self.max_tokens, sampling, self.stop, self.method,
                   self.timeout, token_sources=self.token_sources, stream=self.stream,
                   domain=self.domain, cache_prompt=self.cache_prompt)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def put(self, event: Event) -> None:
        """From the worker thread: hand an event to the handler's loop."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._cancelled.set()

    def queue_time(self) -> float:
        return (self.started or time.monotonic()) - self.arrived


@dataclass
class _Running:
    job: Job
    slot: int
    engine: TextGenerator
    pieces: TokenPieces | None
    reserved: int  # KV entries it may come to hold
    domain: str | None = None  # online distillation: the domain its record trains
    recorder: Recorder | HeadRecorder | None = None  # online distillation: its record


class Scheduler:
    """The FIFO queue in front of up to `max_batch` requests decoded together."""

    def __init__(self, instance: ModelInstance, max_queue: int,
                 metrics: ServeMetrics | None = None, max_batch: int = 1,
                 priced: bool = True, slots: int | None = None) -> None:
        """max_batch: requests decoded together (1: one at a time, on the models' own
        cache); slots: sequences of the KV cache (at least max_batch): an idle one keeps its
        last request's tokens for the next turn of that conversation; priced: drafts of
        requests decoded together are cut to what pays over the batch (its cost measured
        when the worker starts)."""
        self.instance = instance
        self.max_queue = max(0, max_queue)
        self.metrics = metrics
        self.draining = False
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._durations: deque[float] = deque(maxlen=32)  # recent service times
        self._trimmer = Trimmer()  # the worker gives freed logits back between rounds
        self.max_batch = max(1, max_batch)
        slots = max(self.max_batch, slots or self.max_batch)
        if self.max_batch > 1:
            instance.open_slots(slots)  # InputError where a runtime keeps one sequence
        else:
            instance.own_slot()
        self.kv_tokens = min(view.max_context for view, _ in instance.slots)
        # the slots share kv_tokens cells (ik_llama.cpp), or each has as many of its own
        self.pooled = all(getattr(view, "pooled_cache", False) for view, _ in instance.slots)
        self.priced = priced and self.max_batch > 1
        self.decoder = BatchDecoder()
        self._running: dict[str, _Running] = {}
        # idle slots, least recently used first: a prompt takes the one holding the longest
        # start of it, else the one used longest ago; room is made in the same order
        self._free = list(range(len(instance.slots)))
        # idle slots' tokens dropped: to make room, or taken by a request that does not
        # continue the slot's last request (its prompt not kept: another conversation)
        self.evicted = 0
        self._last_prompt: dict[int, int] = {}  # a slot's last prompt's length
        self._recorders: dict[int, Any] = {}  # online distillation: a Recorder per slot

    # ------------------------------------------------------------ event-loop side
    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return bool(self._running)

    def start(self) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="adaspec-serve-worker",
                                                daemon=True)
                self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise the ServeError to answer (429 full, 503 draining)."""
        self.start()
        with self._cond:
            if self.draining:
                raise errors.draining()
            free = max(0, self.max_batch - len(self._running))
            if len(self._waiting) >= self.max_queue + max(0, free):
                raise errors.queue_full(self.retry_after(len(self._waiting) + 1))
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """The client is gone (or its time is up): drop the job if it waits, stop it at the
        next step if it runs."""
        if job.cancelled:
            return
        job.cancel_reason = reason
        job._cancelled.set()
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return  # running (the worker ends it) or done
        job.put(Event(ERROR, error=errors.client_gone()))
        if self.metrics:
            self.metrics.ended_early(job.method, reason)

    def retry_after(self, ahead: int) -> int:
        """Seconds until a place is likely free: recent service time times the jobs ahead."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, min(600, math.ceil(mean * max(1, ahead))))

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            for job in self._waiting:
                job._cancelled.set()
                job.put(Event(ERROR, error=errors.draining()))
            self._waiting.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------ worker side
    def health(self) -> dict[str, Any]:
        return {"busy": self.busy, "queue_depth": self.queue_depth, "max_queue": self.max_queue,
                "draining": self.draining, "running": len(self._running),
                "max_batch": self.max_batch, "kv_tokens": self.kv_tokens,
                "prefix_cache": self.prefix_cache()}

    def prefix_cache(self) -> dict[str, int]:
        """What idle slots keep for a conversation's next turn (read without the lock: a
        snapshot for /health and /metrics)."""
        kept = [len(self._slot_ids(s)) for s in list(self._free)]
        return {"slots": len(self.instance.slots), "kept": sum(1 for n in kept if n),
                "kept_tokens": sum(kept), "evicted": self.evicted}

    def _run(self) -> None:
        if self.priced:
            self._measure_cost()
        while True:
            online = self.instance.online
            with self._cond:
                while not self._waiting and not self._running and not self._stopping:
                    # with online distillation an idle worker takes finished updates
                    if not self._cond.wait(timeout=1.0 if online is not None else None):
                        self._collect(online)
                if self._stopping:
                    for running in list(self._running.values()):
                        self.decoder.drop(running.job.id)
                        self._end(running.job, "cancelled", errors.draining())
                    self._running.clear()
                    return
                admitted = self._admit()
            for job, slot in admitted:
                self._start_job(job, slot)
            self._check_running()
            if not self._running:
                continue
            self.decoder.waiting = len(self._waiting)  # its drafts' worth depends on it
            try:
                # a step's tokens go out before the round's calls run: a client does not
                # wait for the next step's call to see them
                for key, item in self.decoder.advance():
                    member = self._running.get(str(key))
                    if member is not None:
                        self._deliver(member, item)
                events = self.decoder.run()
            except Exception:  # never let one round kill the worker
                log.exception("a decoding round failed")
                for running in list(self._running.values()):
                    self._finish(running, error=errors.ServeError(
                        500, "internal error while decoding", type="server_error"))
                continue
            if self.metrics is not None and self.decoder.last.sequences and self.max_batch > 1:
                self.metrics.batch_round(self.decoder.last, self.decoder.modelled_ms())
            for key, item in events:
                member = self._running.get(str(key))
                if member is not None:
                    self._deliver(member, item)
            self._trimmer.maybe()  # between rounds

    @staticmethod
    def _collect(online: Any) -> None:
        try:
            online.collect()
        except Exception:  # distillation never stops serving
            log.exception("online distillation: collecting updates failed")

    def _measure_cost(self) -> None:
        from adaspec.cost.batch import batch_cost_for

        try:
            views = [view for view, _ in self.instance.slots]
            cost = batch_cost_for(self.instance.target, views)
            self.decoder.cost = cost.ms
        except Exception:  # unpriced batches still serve: drafts as their engines chose
            log.exception("measuring the batch cost failed; drafts go unpriced")

    def _admit(self) -> list[tuple[Job, int]]:
        """Waiting requests that get a slot now (under the lock): in order, while a slot is
        free and the KV cache has room for the head of the queue."""
        admitted = []
        while self._waiting and self._free and len(self._running) < self.max_batch:
            job = self._waiting[0]
            # the slot holding the longest start of the prompt; ties (none: the least
            # recently used, first in `_free`)
            slot = max(self._free, key=lambda s: common_prefix(self._slot_ids(s),
                                                               job.prompt_ids)) \
                if job.cache_prompt else self._free[0]
            need = len(job.prompt_ids) + job.max_tokens + DRAFT_ROOM
            held = sum(r.reserved for r in self._running.values()) if self.pooled else 0
            kept = {s: len(self._slot_ids(s)) for s in self._free if s != slot and self.pooled}
            if held + sum(kept.values()) + need > self.kv_tokens:
                for s in [s for s in self._free if kept.get(s)]:  # least recently used first
                    self._reset_slot(s)
                    self._last_prompt.pop(s, None)
                    self.evicted += 1
                    kept[s] = 0
                    if held + sum(kept.values()) + need <= self.kv_tokens:
                        break
                if held + sum(kept.values()) + need > self.kv_tokens and self._running:
                    break  # waits for a running request to end
            self._waiting.popleft()
            if common_prefix(self._slot_ids(slot), job.prompt_ids) < self._last_prompt.get(
                    slot, 0) - BOUNDARY:  # not its last request's conversation
                self.evicted += 1
            self._last_prompt[slot] = len(job.prompt_ids)
            self._free.remove(slot)
            self._running[job.id] = _Running(job, slot, None, None, need)  # type: ignore[arg-type]
            admitted.append((job, slot))
        return admitted

    def _slot_ids(self, slot: int) -> list[int]:
        """What slot `slot`'s target sequence holds (none where its backend cannot say)."""
        held = getattr(self.instance.slots[slot][0], "held", None)
        return held() if callable(held) else []

    def _reset_slot(self, slot: int) -> None:
        for backend in self.instance.slots[slot]:
            if backend is not None:
                backend.reset()

    def _start_job(self, job: Job, slot: int) -> None:
        running = self._running[job.id]
        if job.cancelled:
            self._finish(running, error=errors.client_gone(), outcome=job.cancel_reason)
            return
        job.started = time.monotonic()
        if self.metrics:
            self.metrics.queue_wait.observe(job.queue_time())
        if job.started > job.deadline:
            self._finish(running, error=errors.timed_out(job.timeout), outcome="timeout")
            return
        try:
            running.engine = self.instance.request_engine(job.method, slot)
            running.recorder = self._recorder_for(running, slot)
            # decoded with others, its drafter prices what it drafts against the batch's
            # rounds; alone, as a request alone
            seat = self.decoder.seat() if self.max_batch > 1 else None
            steps = running.engine.stream_steps(job.prompt_ids, job.max_tokens, job.sampling,
                                                job.stop, chat=False, seat=seat,
                                                recorder=running.recorder,
                                                reuse=len(job.prompt_ids)
                                                if job.cache_prompt else 0)
        except AdaspecError as exc:  # a method its parts cannot be built for, a bad input
            self._finish(running, error=errors.bad_request(str(exc), param="method"))
            return
        running.pieces = TokenPieces(self.instance.tokenizer) if job.token_sources else None
        self.decoder.add(job.id, steps, seat)

    def _recorder_for(self, running: _Running, slot: int) -> Recorder | HeadRecorder | None:
        """Online distillation of a default-method request: this slot's recorder, the
        request's domain chosen, the draft switched to it where no running request has
        another domain (`OnlineDistiller.before_request`); None: not recorded."""
        online = self.instance.online
        if online is None or running.job.method != self.instance.default_method:
            return None
        try:
            online.check_engine(running.engine)  # it drafts with the distilled draft
            # the models' own slot: the distiller's own recorder
            recorder = online.recorder if self.max_batch == 1 else self._recorders.get(slot)
            if recorder is None:
                recorder = self._recorders[slot] = online.new_recorder()
            running.domain = online.domain(running.job.domain, running.job.prompt_ids)
            online.prepare(running.engine, running.domain)  # a head per domain: its own
            others = {r.domain for r in self._running.values()
                      if r is not running and r.domain is not None}
            if others <= {running.domain}:
                online.before_request(running.domain)
        except Exception:  # distillation never fails a request: serve the current draft
            log.exception("online distillation: starting the record failed")
            running.domain = None
            return None
        return recorder

    def _record_slot(self, running: _Running, result: GenerationResult) -> None:
        online = self.instance.online
        recorder = running.recorder
        if online is None or running.domain is None or recorder is None:
            return
        try:  # the record of the service's own kind (a draft model's, or the head's row)
            record: Any = recorder.take(result.token_ids, running.domain,
                                        result.stats.drafted, result.stats.accepted)
            online.after_request(record)
        except Exception:  # distillation never fails a request
            log.exception("online distillation: recording the request failed")

    def _check_running(self) -> None:
        now = time.monotonic()
        for running in list(self._running.values()):
            job = running.job
            if job.id not in self.decoder:
                continue
            if job.cancelled:
                self._finish(running, error=errors.client_gone(), outcome=job.cancel_reason)
            elif now > job.deadline:
                self._finish(running, error=errors.timed_out(job.timeout), outcome="timeout")

    def _deliver(self, running: _Running, item: StreamChunk | GenerationResult | Exception
                 ) -> None:
        job = running.job
        if isinstance(item, StreamChunk):
            if job.first_token is None and item.token_ids:
                job.first_token = time.monotonic()
            if job.stream:
                cut = [running.pieces.push(t) for t in item.token_ids] if running.pieces \
                    else None
                job.put(Event(CHUNK, chunk=item, pieces=cut))
        elif isinstance(item, GenerationResult):
            self._record_slot(running, item)
            self._finished(job, item)
            self._learn(running.engine)
            self._finish(running)
        elif isinstance(item, InputError):  # e.g. a prompt too long for this method's draft
            self._finish(running, error=errors.bad_request(str(item)))
        else:
            log.error("request %s failed: %s: %s", job.id, type(item).__name__, item)
            self._finish(running, error=errors.ServeError(
                500, "internal error while decoding", type="server_error"))

    def _finish(self, running: _Running, error: errors.ServeError | None = None,
                outcome: str = "error") -> None:
        """The request is over (done, failed or stopped): its slot is free."""
        job = running.job
        self.decoder.drop(job.id)
        if error is not None:
            self._end(job, outcome, error)
        with self._cond:
            if self._running.pop(job.id, None) is not None:
                self._free.append(running.slot)
        if job.started is not None:
            self._durations.append(time.monotonic() - job.started)

    def _learn(self, engine) -> None:
        done = getattr(self.instance, "request_done", None)
        if done is None:
            return
        try:
            done(engine)
        except Exception:  # the history never fails a request
            log.exception("history: learning from the request failed")

    def _finished(self, job: Job, result: GenerationResult) -> None:
        job.put(Event(DONE, result=result))
        if self.metrics:
            now = time.monotonic()
            ttft = job.first_token - job.arrived if job.first_token is not None else None
            self.metrics.finished(job.method, result.stats, result.finish_reason, ttft,
                                  now - job.arrived)

    def _end(self, job: Job, outcome: str, error: errors.ServeError) -> None:
        job.put(Event(ERROR, error=error))
        if self.metrics:
            self.metrics.ended_early(job.method, outcome)
