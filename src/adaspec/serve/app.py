"""The FastAPI app: the OpenAI-compatible routes, /health, /metrics and the playground.

`create_app(config)` loads the models when the app starts (its lifespan);
`create_app(config, instance)` serves models already loaded (tests, Ray replicas).
A handler checks everything it can before the request waits in the queue (fields, method
string, prompt length), so bad input gets its 400 at once and never reaches the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from adaspec.core.sampling import SEED_MAX, SamplingParams
from adaspec.engine.steps import GenerationResult
from adaspec.errors import InputError
from adaspec.methods.registry import METHODS
from adaspec.serve import auth, errors, responses
from adaspec.serve.config import ServeConfig
from adaspec.serve.errors import ServeError
from adaspec.serve.instance import ModelInstance
from adaspec.serve.metrics import CONTENT_TYPE, ServeMetrics
from adaspec.serve.scheduler import CHUNK, DONE, ERROR, Event, Job, Scheduler
from adaspec.serve.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    ModelCard,
    ModelList,
    Usage,
)
from adaspec.serve.tools import Tools, ToolStream

log = logging.getLogger("adaspec.serve")

PLAYGROUND = "playground"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/")
TIMEOUT_GRACE = 0.25  # the worker stops a late job between steps; the handler waits this more
MAX_BODY = 16 * 1024 * 1024  # bytes of a request body (by its Content-Length); more: 413


class ServeState:
    """What the routes share: the config, the models, the scheduler and the metrics."""

    def __init__(self, config: ServeConfig, instance: ModelInstance | None) -> None:
        self.config = config
        self.instance = instance
        self.scheduler: Scheduler | None = None
        self.metrics = ServeMetrics(
            queue_depth=lambda: self.scheduler.queue_depth if self.scheduler else 0,
            busy=lambda: float(self.scheduler.busy) if self.scheduler else 0.0,
            prefix_cache=self._prefix_cache,
        )
        self.model = config.served_name()
        self.created = responses.now()

    def _prefix_cache(self) -> dict[str, int]:
        read = getattr(self.scheduler, "prefix_cache", None)
        return read() if callable(read) else {}

    def start(self, instance: ModelInstance) -> Scheduler:
        self.instance = instance
        if self.scheduler is None:
            self.scheduler = Scheduler(instance, self.config.max_queue, self.metrics,
                                       max_batch=self.config.max_batch,
                                       slots=self.config.sequences())
        self.scheduler.start()
        return self.scheduler

    def ready(self) -> tuple[ModelInstance, Scheduler]:
        if self.instance is None or self.scheduler is None:
            raise ServeError(503, "the models are still loading", type="server_error",
                             code="loading", headers={"Retry-After": "5"})
        return self.instance, self.scheduler


class GuardMiddleware:
    """Pure ASGI (it leaves `receive` alone, so disconnects reach the handlers): the API key
    check, the body size limit, and the request counter by endpoint and status."""

    def __init__(self, app: ASGIApp, state: ServeState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        counted = False

        async def counting_send(message: Message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.state.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        try:
            request = Request(scope)
            auth.check(request, self.state.config.api_key)
            length = request.headers.get("content-length", "0")
            if length.isdigit() and int(length) > MAX_BODY:
                raise ServeError(413, f"request body over {MAX_BODY // (1024 * 1024)} MiB")
        except ServeError as exc:
            await error_response(exc)(scope, receive, counting_send)
            return
        await self.app(scope, receive, counting_send)


def error_response(exc: ServeError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def create_app(config: ServeConfig, instance: ModelInstance | None = None) -> FastAPI:
    state = ServeState(config, instance)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = state.instance is None
        loaded = state.instance
        if loaded is None:
            loaded = await run_in_threadpool(ModelInstance.load, config)
        scheduler = state.start(loaded)
        try:
            yield
        finally:
            scheduler.stop()
            if owned:
                loaded.close()

    app = FastAPI(title="adaspec", version="0.1.0", lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.state.adaspec = state
    app.add_middleware(GuardMiddleware, state=state)

    @app.exception_handler(ServeError)
    async def _serve_error(request: Request, exc: ServeError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = errors.validation_message(list(exc.errors()))
        return error_response(errors.bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"no route {request.method} {request.url.path}" \
            if exc.status_code in (404, 405) else str(exc.detail)
        return error_response(ServeError(exc.status_code, message, type=kind))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(ServeError(500, "internal server error", type="server_error"))

    # ------------------------------------------------------------------ routes
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await generate(state, request, body, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await generate(state, request, body, chat=False)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[ModelCard(id=state.model, created=state.created)]).model_dump()

    @app.get("/health")
    async def health() -> JSONResponse:
        inst, sched = state.instance, state.scheduler
        draining = sched is not None and sched.draining
        body: dict[str, Any] = {
            "status": "draining" if draining else ("ok" if sched else "loading"),
            "model": state.model,
            "method": inst.default_method if inst else config.method,
            "methods": METHODS.names(),
            "concurrency": config.max_batch,
            "note": f"{config.slots()}; others wait in a FIFO queue of at most max_queue, "
                    "then get 429",
            "timeout": config.timeout,
            "auth": bool(config.api_key),
            "pid": os.getpid(),  # tells replicas apart behind a proxy
        }
        if inst is not None:
            body.update(target=inst.target.name,
                        draft=inst.draft.name if inst.draft is not None else None,
                        max_context=inst.max_context)
            if inst.online is not None:
                body["online_distillation"] = inst.online.status()
            if inst.history is not None:  # a cache that grows to its budget, then holds
                index = inst.history.index
                body["history"] = {"tokens": index.tokens, "budget": index.budget,
                                   "documents": index.documents}
        if sched is not None:
            body.update(sched.health())
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(_playground_dir() + "/index.html")

    app.mount("/playground", StaticFiles(packages=[("adaspec.serve", PLAYGROUND)]),
              name="playground")
    return app


def _playground_dir() -> str:
    from importlib.resources import files

    return str(files("adaspec.serve") / PLAYGROUND)


def _named(message: str) -> str | None:
    """The request field a sampling error names, if any."""
    return next((f for f in ("logit_bias", "presence_penalty", "frequency_penalty")
                 if message.startswith(f)), None)


# ---------------------------------------------------------------------- generation
async def prepare(state: ServeState, body: GenerationRequest, chat: bool
                  ) -> tuple[Job, Tools | None]:
    """Check a request and turn it into a job (and the tools its answer may call); every
    problem is a ServeError (400/404)."""
    instance, _ = state.ready()
    if body.model and body.model != state.model:
        raise ServeError(404, f"model {body.model!r} is not served here; this server serves "
                         f"{state.model!r} (GET /v1/models)", type="not_found_error",
                         param="model", code="model_not_found")
    method = instance.default_method
    if body.method is not None:
        try:
            method = instance.check_method(body.method).text
        except InputError as exc:
            raise errors.bad_request(str(exc), param="method") from None
    try:
        logprobs = body.logprob_count(chat)
    except ValueError as exc:
        raise errors.bad_request(str(exc), param="logprobs") from None
    tools = None
    if isinstance(body, ChatCompletionRequest):
        try:
            tools = body.tool_spec()
        except InputError as exc:
            raise errors.bad_request(str(exc), param="tools") from None
    try:
        grammar, asked = body.grammar()
    except InputError as exc:
        raise errors.bad_request(str(exc), param="response_format" if chat else None) \
            from None
    try:
        bias = body.bias()
        vocab = instance.target.vocab_size
        if any(not 0 <= token < vocab for token, _ in bias):
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab})")
    except ValueError as exc:
        raise errors.bad_request(str(exc), param="logit_bias") from None
    try:
        sampling = SamplingParams(body.temperature, body.top_k, body.top_p, body.seed,
                                  logprobs=logprobs, grammar=grammar, logit_bias=bias,
                                  presence_penalty=body.presence_penalty or 0.0,
                                  frequency_penalty=body.frequency_penalty or 0.0)
    except InputError as exc:
        raise errors.bad_request(str(exc), param=asked or _named(str(exc))) from None
    field = "messages" if chat else "prompt"
    try:
        if isinstance(body, ChatCompletionRequest):
            prompt: Any = body.chat_turns()
        else:
            assert isinstance(body, CompletionRequest)
            prompt = body.prompt_input()
    except ValueError as exc:
        raise errors.bad_request(str(exc), param=field) from None
    try:
        ids = await run_in_threadpool(instance.encode, prompt, chat,
                                      tools.for_template() if tools else None)
    except InputError as exc:
        raise errors.bad_request(str(exc), param=field) from None
    except (ValueError, KeyError, TypeError) as exc:  # the tokenizer's own complaint
        raise errors.bad_request(f"the {field} could not be tokenized: {exc}",
                                 param=field) from None
    room = instance.max_context - len(ids)
    budget = body.token_budget()
    if budget is None:
        budget = min(state.config.default_max_tokens, room)
    if budget < 1 or len(ids) + budget > instance.max_context:
        raise errors.bad_request(
            f"context too long: the prompt has {len(ids)} tokens and max_tokens is "
            f"{body.token_budget() or budget}, more than the context window of "
            f"{instance.max_context} tokens; shorten the prompt or lower max_tokens",
            param=field)
    job = Job(ids, budget, sampling, body.stop_list(), method, state.config.timeout,
              token_sources=body.token_sources, stream=body.stream, domain=body.domain,
              cache_prompt=body.cache_prompt)
    return job, tools


async def next_event(job: Job, scheduler: Scheduler) -> Event:
    """The job's next event; at the deadline, the job is cancelled and a 504 raised."""
    left = job.deadline - time.monotonic() + TIMEOUT_GRACE
    try:
        return await asyncio.wait_for(job.events.get(), timeout=max(0.01, left))
    except TimeoutError:
        scheduler.cancel(job, reason="timeout")
        raise errors.timed_out(job.timeout) from None


async def final_result(job: Job, scheduler: Scheduler,
                       first: Event | None = None) -> GenerationResult:
    """The job's result, its chunks passed over (`first`: its first event, already read);
    its error raised."""
    event = first or await next_event(job, scheduler)
    while event.kind == CHUNK:
        event = await next_event(job, scheduler)
    if event.kind == ERROR:
        assert event.error is not None
        raise event.error
    assert event.result is not None
    return event.result


async def watch_disconnect(request: Request, scheduler: Scheduler, job: Job) -> None:
    """Cancel the job as soon as the client disconnects (the worker stops within a step)."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                scheduler.cancel(job)
                return
    except Exception:  # the connection is gone in some other way: nothing to watch
        return


async def generate(state: ServeState, request: Request, body: GenerationRequest,
                   chat: bool) -> Response:
    job, tools = await prepare(state, body, chat)
    _, scheduler = state.ready()
    if body.n > 1:
        return await generate_many(state, request, body, chat, job, tools)
    scheduler.submit(job)  # 429 / 503 raised here
    watcher = asyncio.create_task(watch_disconnect(request, scheduler, job))
    handed_over = False
    try:
        first = await next_event(job, scheduler)
        if first.kind == ERROR:
            assert first.error is not None
            raise first.error
        rid, created = responses.new_id(chat), responses.now()
        if body.stream:
            handed_over = True
            return StreamingResponse(
                stream_events(state, scheduler, [job], first, body, chat, rid, created,
                              [watcher], tools is not None),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        result = await final_result(job, scheduler, first)
        use = responses.usage(result, job.method, job.queue_time())
        instance, _ = state.ready()
        if chat:
            return JSONResponse(responses.chat_completion(
                rid, created, state.model, result, use, instance.token_text,
                tools=tools is not None))
        return JSONResponse(responses.completion(rid, created, state.model, result,
                                                 use, instance.token_text))
    finally:
        if not handed_over:
            watcher.cancel()
            scheduler.cancel(job)


async def generate_many(state: ServeState, request: Request, body: GenerationRequest,
                        chat: bool, job: Job, tools: Tools | None) -> Response:
    """`n` answers to one prompt, decoded as requests of their own (together, up to
    --max-batch: their prompt prefilled once and shared); a seed gives answer i the seed
    + i. One response, `choices[i]` answer i, usage summed over the answers; streamed,
    the answers' chunks interleaved by `index`."""
    _, scheduler = state.ready()
    s = job.sampling
    jobs = [job] + [job.again(dataclasses.replace(
        s, seed=None if s.seed is None else (s.seed + i) % (SEED_MAX + 1)))
        for i in range(1, body.n)]
    submitted: list[Job] = []
    watchers: list[asyncio.Task] = []
    handed_over = False
    try:
        for j in jobs:
            scheduler.submit(j)  # 429 / 503 raised here; those already in are cancelled
            submitted.append(j)
            watchers.append(asyncio.create_task(watch_disconnect(request, scheduler, j)))
        if body.stream:
            handed_over = True
            return StreamingResponse(
                stream_events(state, scheduler, jobs, None, body, chat,
                              responses.new_id(chat), responses.now(), watchers,
                              tools is not None),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        results = [await final_result(j, scheduler) for j in jobs]
        rid, created = responses.new_id(chat), responses.now()
        instance, _ = state.ready()
        bodies = []
        for j, result in zip(jobs, results, strict=True):
            use = responses.usage(result, j.method, j.queue_time())
            bodies.append(responses.chat_completion(
                rid, created, state.model, result, use, instance.token_text,
                tools=tools is not None) if chat else responses.completion(
                rid, created, state.model, result, use, instance.token_text))
        return JSONResponse(responses.merge_choices(bodies))
    finally:
        if not handed_over:
            for w in watchers:
                w.cancel()
            for j in submitted:
                scheduler.cancel(j)


async def stream_events(state: ServeState, scheduler: Scheduler, jobs: list[Job],
                        first: Event | None, body: GenerationRequest, chat: bool, rid: str,
                        created: int, watchers: list[asyncio.Task], tools: bool = False
                        ) -> AsyncIterator[bytes]:
    """Server-sent events of one answer or `n` (`index` i: answer i, interleaved as they
    come): the chunks, a last chunk per answer with its finish_reason and usage, the
    usage-only chunk (summed over the answers) if stream_options.include_usage asked for it,
    then [DONE]. An error after the stream began is one `data: {"error": ...}` event, and
    the stream ends. `first`: answer 0's first event, already read. `tools`: the request has
    tools: text that may be a tool call is held back, and an answer's calls go out as
    `tool_calls` deltas as they are written (`serve/tools.py`'s `ToolStream`)."""
    model = state.model
    calls = [ToolStream() if tools else None for _ in jobs]
    offsets = [0] * len(jobs)  # completions' text_offset: characters streamed so far
    pending: dict[int, asyncio.Task] = {}
    finished: list[dict[str, Any]] = []
    try:
        if chat:
            for i in range(len(jobs)):
                yield responses.sse(responses.chunk(True, rid, created, model, role=True,
                                                    text="", index=i))
        ready: list[tuple[int, Event]] = [(0, first)] if first is not None else []
        for i in range(len(ready), len(jobs)):
            pending[i] = asyncio.ensure_future(next_event(jobs[i], scheduler))
        while ready or pending:
            if not ready:
                done, _ = await asyncio.wait(pending.values(),
                                             return_when=asyncio.FIRST_COMPLETED)
                for i in [i for i, task in pending.items() if task in done]:
                    try:
                        ready.append((i, pending.pop(i).result()))
                    except ServeError as exc:
                        ready.append((i, Event(ERROR, error=exc)))
            i, event = ready.pop(0)
            job = jobs[i]
            if event.kind == CHUNK:
                assert event.chunk is not None
                tokens = None
                if event.pieces is not None:
                    tokens = [[p, src] for p, src in zip(event.pieces, event.chunk.sources,
                                                         strict=False)]
                logprobs = None
                if job.sampling.logprobs is not None and event.chunk.logprobs:
                    instance, _ = state.ready()
                    logprobs = responses.logprobs(chat, event.chunk.logprobs,
                                                  instance.token_text, offsets[i])
                    if not chat:
                        offsets[i] += sum(len(t) for t in logprobs["tokens"])
                text = event.chunk.text
                held = calls[i]
                deltas = (held.push(text) if held is not None
                          else [{"content": text}] if text else [])
                if not deltas and (tokens or logprobs):
                    deltas = [{"content": ""}]
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    yield responses.sse(responses.chunk(
                        chat, rid, created, model, text=delta.get("content"),
                        tool_calls=delta.get("tool_calls"), index=i,
                        tokens=tokens if last else None, logprobs=logprobs if last else None))
                pending[i] = asyncio.ensure_future(next_event(job, scheduler))
            elif event.kind == DONE:
                assert event.result is not None
                use = responses.usage(event.result, job.method, job.queue_time())
                finish = responses.FINISH[event.result.finish_reason]
                filt = calls[i]
                if filt is not None:
                    for delta in filt.finish():
                        yield responses.sse(responses.chunk(
                            True, rid, created, model, text=delta.get("content"),
                            tool_calls=delta.get("tool_calls"), index=i))
                    if filt.called:
                        finish = "tool_calls"
                yield responses.sse(responses.chunk(
                    chat, rid, created, model, text=None if chat else "",
                    finish_reason=finish, use=use, index=i))
                finished.append({"usage": use.model_dump(), "choices": [{}]})
            else:
                assert event.error is not None
                yield responses.sse(event.error.body())
                return
        if body.include_usage():
            total = responses.merge_choices(finished)["usage"]
            yield responses.sse(responses.chunk(chat, rid, created, model,
                                                use=Usage(**total), no_choice=True))
        yield responses.DONE_EVENT
    finally:
        for task in pending.values():
            task.cancel()
        for watcher in watchers:
            watcher.cancel()
        for job in jobs:
            scheduler.cancel(job)
