"""The bounded FIFO queue and the one worker thread that owns a model instance.

HTTP handlers run on the event loop; decoding runs on the worker thread, one request at a
time (the models hold one KV cache each). A handler submits a `Job` and reads its events
(chunks, then the result or an error) from an asyncio queue the worker fills. The worker
looks at the job between decode steps: a job whose client went away (`cancel`) or whose
deadline passed stops there, and the engine's stream is closed, which ends its decoding, so
the models are free for the next job within one step.
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
from typing import Any

from adaspec.backends.memory import Trimmer
from adaspec.core.sampling import SamplingParams
from adaspec.engine.loop import GenerationResult, StreamChunk
from adaspec.errors import AdaspecError, InputError
from adaspec.serve import errors
from adaspec.serve.instance import ModelInstance
from adaspec.serve.metrics import ServeMetrics
from adaspec.serve.pieces import TokenPieces

log = logging.getLogger("adaspec.serve")

CHUNK, DONE, ERROR = "chunk", "done", "error"


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
                 domain: str | None = None) -> None:
        self.id = uuid.uuid4().hex[:24]
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.stop = stop
        self.method = method
        self.token_sources = token_sources
        self.domain = domain  # the request's own domain field (online distillation)
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


class Scheduler:
    def __init__(self, instance: ModelInstance, max_queue: int,
                 metrics: ServeMetrics | None = None) -> None:
        self.instance = instance
        self.max_queue = max(0, max_queue)
        self.metrics = metrics
        self.draining = False
        self._waiting: deque[Job] = deque()
        self._current: Job | None = None
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._durations: deque[float] = deque(maxlen=32)  # recent service times
        self._trimmer = Trimmer()  # the worker gives freed logits back between requests

    # ------------------------------------------------------------ event-loop side
    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return self._current is not None

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
            in_system = len(self._waiting) + (self._current is not None)
            if in_system > self.max_queue:
                raise errors.queue_full(self.retry_after(in_system))
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
    def _run(self) -> None:
        online = getattr(self.instance, "online", None)
        # with online distillation, an idle worker thread takes finished updates every second
        # (what /health reports; the swap itself waits for the domain's next request)
        idle_poll = 1.0 if online is not None else None
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    if not self._cond.wait(timeout=idle_poll):
                        break
                if self._stopping:
                    return
                job = self._current = self._waiting.popleft() if self._waiting else None
            if job is None:
                try:
                    assert online is not None  # no job: only an idle poll, i.e. online is set
                    online.collect()
                except Exception:  # distillation never stops the server
                    log.exception("online distillation: collecting updates failed")
                continue
            try:
                self._serve(job)
            except Exception:  # never let one request kill the worker
                log.exception("request %s failed", job.id)
                self._end(job, "error", errors.ServeError(
                    500, "internal error while decoding", type="server_error"))
            finally:
                with self._cond:
                    self._current = None
                if job.started is not None:
                    self._durations.append(time.monotonic() - job.started)
            self._trimmer.maybe()

    def _serve(self, job: Job) -> None:
        if job.cancelled:  # cancelled between leaving the queue and starting
            self._end(job, job.cancel_reason, errors.client_gone())
            return
        job.started = time.monotonic()
        if self.metrics:
            self.metrics.queue_wait.observe(job.queue_time())
        if job.started > job.deadline:
            self._end(job, "timeout", errors.timed_out(job.timeout))
            return
        try:
            engine = self.instance.engine(job.method)
        except AdaspecError as exc:  # a method its parts cannot be built for (missing file...)
            self._end(job, "error", errors.bad_request(str(exc), param="method"))
            return
        online = self.instance.online if job.method == self.instance.default_method else None
        domain = ""
        if online is not None:  # between requests: the draft of this request's domain
            try:
                domain = online.domain(job.domain, job.prompt_ids)
                online.before_request(domain)
            except Exception:  # distillation never fails a request: serve the current draft
                log.exception("online distillation: the draft swap failed")
        stream = engine.stream(job.prompt_ids, job.max_tokens, job.sampling, job.stop,
                               chat=False)
        pieces = TokenPieces(self.instance.tokenizer) if job.token_sources else None
        try:
            for item in stream:
                if isinstance(item, StreamChunk):
                    if job.first_token is None and item.token_ids:
                        job.first_token = time.monotonic()
                    if job.stream:
                        cut = [pieces.push(t) for t in item.token_ids] if pieces else None
                        job.put(Event(CHUNK, chunk=item, pieces=cut))
                else:
                    if online is not None:
                        self._record(online, item, domain)
                    self._finished(job, item)
                    self._learn(engine)
                    return
                if job.cancelled:
                    self._end(job, job.cancel_reason, errors.client_gone())
                    return
                if time.monotonic() > job.deadline:
                    self._end(job, "timeout", errors.timed_out(job.timeout))
                    return
        except InputError as exc:  # e.g. a prompt too long for this method's draft model
            self._end(job, "error", errors.bad_request(str(exc)))
        finally:
            stream.close()  # stops the decoding where it is

    @staticmethod
    def _record(online, result: GenerationResult, domain: str) -> None:
        try:
            online.after_request(online.recorder.take(
                result.token_ids, domain, result.stats.drafted, result.stats.accepted))
        except Exception:  # distillation never fails a request
            log.exception("online distillation: recording the request failed")

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

    def health(self) -> dict[str, Any]:
        return {
            "busy": self.busy,
            "queue_depth": self.queue_depth,
            "max_queue": self.max_queue,
            "draining": self.draining,
        }
