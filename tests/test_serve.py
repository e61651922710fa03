"""`adaspec serve` on loopback with tiny models: the official openai client against a live
server (uvicorn in a thread), SSE framing, stop strings, seeds, the queue's 429, cancellation
on disconnect, timeouts, the API key, bad input, metrics, and SIGTERM drain (a subprocess).

Helpers here (`served_instance`, `live_server`, `SlowBackend`) serve the other
tests/test_serve_*.py files too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="needs httpx: pip install -e '.[serve]'")
import uvicorn  # noqa: E402

from adaspec.backends.load import load_backends  # noqa: E402
from adaspec.serve.app import create_app  # noqa: E402
from adaspec.serve.config import ServeConfig  # noqa: E402
from adaspec.serve.instance import ModelInstance  # noqa: E402

MODEL = "tiny"
METHOD = "draft:k=3"
PROMPT = "def add(a, b):"
REPO = Path(__file__).resolve().parents[1]


class SlowBackend:
    """A backend whose forward passes take at least `delay` seconds: long enough requests
    to queue behind, disconnect from and time out, on a model that is otherwise instant."""

    def __init__(self, inner, delay: float = 0.0) -> None:
        self._inner = inner
        self.delay = delay
        self.gate: threading.Semaphore | None = None  # set: each forward pass takes a permit
        self.calls = 0  # forward passes so far (a sequence's count on its owner)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def forward(self, *args, **kwargs):
        owner = self._parent if "_parent" in self.__dict__ else self
        gate = owner.gate
        if gate is not None and not gate.acquire(timeout=60):
            raise RuntimeError("a test's gate stayed closed for 60 s")
        owner.calls += 1
        if owner.delay:
            time.sleep(owner.delay)
        return self._inner.forward(*args, **kwargs)

    def sequences(self, n: int) -> list:
        """Sequences of a server decoding requests together, slowed with this backend."""
        views = [SlowBackend(v) for v in self._inner.sequences(n)]
        for view in views:
            view._parent = self
        return views

    def prefill(self, tokens, hidden_layer=None, reuse=0):
        self._inner.reset()
        return self.forward(tokens, hidden_layer=hidden_layer)


def served_instance(target_dir: str, draft_dir: str | None, method: str = METHOD
                    ) -> ModelInstance:
    target, tokenizer, draft, eos = load_backends(target_dir, draft_dir, "float32", "none",
                                                  "none")
    return ModelInstance(SlowBackend(target), tokenizer, draft, eos, method)


@contextmanager
def live_server(instance: ModelInstance, **config) -> Iterator[str]:
    """A uvicorn server in a thread on a free loopback port; yields its base URL."""
    cfg = ServeConfig(**{"method": instance.default_method, "target": MODEL, "draft": None,
                         "port": 0, **config})
    server = uvicorn.Server(uvicorn.Config(create_app(cfg, instance), host="127.0.0.1",
                                           port=0, log_level="warning",
                                           timeout_graceful_shutdown=3))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def slowed(instance: ModelInstance, delay: float) -> Iterator[None]:
    instance.target.delay = delay
    try:
        yield
    finally:
        instance.target.delay = 0.0


@contextmanager
def gated(instance: ModelInstance) -> Iterator[threading.Semaphore]:
    """Hold the target's forward passes at a gate for the block (each takes a permit; the
    test releases what it lets through), so no request ends before the test lets it."""
    gate = instance.target.gate = threading.Semaphore(0)
    try:
        yield gate
    finally:
        open_gate(instance)


def open_gate(instance: ModelInstance) -> None:
    gate, instance.target.gate = instance.target.gate, None
    if gate is not None:
        gate.release(100_000)  # every pass still waiting


def target_passes(url: str, instance: ModelInstance, body: dict) -> int:
    """The target's forward passes of one whole request (it must answer 200)."""
    before = instance.target.calls
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return instance.target.calls - before


def wait_until(check, timeout: float = 5.0, every: float = 0.01) -> float:
    """Seconds until check() held (fails after `timeout`)."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        time.sleep(every)
    return time.monotonic() - start


def health(base: str) -> dict:
    return httpx.get(base + "/health").json()


def sse_events(response) -> list[str]:
    """The `data:` payloads of an SSE response, checking the framing on the way."""
    events = []
    for block in response.text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        events.append(block[len("data: "):])
    assert response.text.endswith("\n\n")
    return events


def metric(base: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                total += sample.value
    return total


@pytest.fixture(scope="module", autouse=True)
def adaspec_home(tmp_path_factory):
    """Caches and profiles of this module's runs go to a temporary home."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADASPEC_HOME", str(tmp_path_factory.mktemp("home")))
        yield


@pytest.fixture(scope="module")
def instance(model_dirs, adaspec_home):
    inst = served_instance(*model_dirs)
    yield inst
    inst.close()


@pytest.fixture(scope="module")
def base(instance):
    with live_server(instance) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    openai = pytest.importorskip("openai", reason="needs the openai client: "
                                 "pip install -e '.[serve]'")
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def library_text(instance: ModelInstance, prompt, n: int, chat: bool, **sampling) -> str:
    from adaspec.core.sampling import SamplingParams

    engine = instance.engine(METHOD)
    return engine.generate(prompt, n, SamplingParams(**sampling), chat=chat).text


# ---------------------------------------------------------------------- the openai client
def test_greedy_completion_equals_adaspec_generate(client, model_dirs, capsys):
    from adaspec.cli import main

    target, draft = model_dirs
    assert main(["generate", PROMPT, "--target", target, "--draft", draft, "--dtype",
                 "float32", "--raw", "--max-new-tokens", "16", "--method", METHOD]) == 0
    cli_text = capsys.readouterr().out[:-1]  # the answer, then one newline
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert out.choices[0].text == cli_text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 16
    spec = out.usage.model_extra["speculation"]
    assert spec["method"] == METHOD and spec["target_calls"] >= 1
    assert spec["drafted"] >= spec["accepted"] >= 0


def test_chat_streaming_and_not_give_the_library_text(client, instance):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    expected = library_text(instance, messages, 20, chat=True)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                         temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.content == expected
    assert out.choices[0].message.role == "assistant"
    assert out.usage.total_tokens == out.usage.prompt_tokens + 20

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_logprobs_are_the_engines_and_streamed_alike(base, instance):
    """Chat: logprobs true + top_logprobs N; completions: logprobs N. Each emitted token's
    log-probability is the engine's (no extra target call), streamed or not; bad
    combinations are 400s naming logprobs."""
    from adaspec.core.sampling import SamplingParams

    engine = instance.engine(METHOD)
    expect = engine.generate(PROMPT, 8, SamplingParams(logprobs=2), chat=True).logprobs
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx([e.logprob for e in expect])
    assert [c["token"] for c in content] == [instance.token_text(e.token) for e in expect]
    assert all(len(c["top_logprobs"]) == 2 and c["bytes"] == list(c["token"].encode())
               for c in content)
    assert "".join(c["token"] for c in content) == r.json()["choices"][0]["message"]["content"]
    streamed = httpx.post(base + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=30)
    parts = [json.loads(e) for e in sse_events(streamed)[:-1]]
    lps = [c for p in parts for ch in p["choices"] if ch["logprobs"]
           for c in ch["logprobs"]["content"]]
    assert lps == content
    plain = httpx.post(base + "/v1/chat/completions", timeout=30,
                       json={**body, "logprobs": False, "top_logprobs": None})
    assert plain.json()["choices"][0]["logprobs"] is None

    r = httpx.post(base + "/v1/completions", timeout=30,
                   json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert all(len(top) <= 3 for top in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert lp["text_offset"][1:] == [sum(map(len, lp["tokens"][:i])) for i in range(1, 6)]
    bad = httpx.post(base + "/v1/chat/completions", timeout=30,
                     json={**body, "logprobs": None})  # top_logprobs without logprobs
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs"


def test_completion_streaming_gives_the_same_text(client, instance):
    expected = library_text(instance, PROMPT, 12, chat=False)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_end_the_answer_before_them(client, instance):
    full = library_text(instance, PROMPT, 30, chat=False)
    stop = full[6:9]
    assert stop.strip() and stop in full
    cut = full[: full.index(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0,
                                    stop=[stop, "never-seen"])
    assert out.choices[0].text == cut
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30,
                                            temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_seed_reproduces_a_sampled_answer(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                          temperature=1.5, top_p=0.95, seed=seed,
                                          extra_body={"top_k": 40}).choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert len({first, sample(8), sample(9), sample(10)}) > 1  # the seed matters


def test_a_request_may_choose_its_method(client):
    outs = {m: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10,
                                         temperature=0, extra_body={"method": m})
            for m in ("ar", "ngram:k=4", "draft:k=2")}
    assert len({o.choices[0].text for o in outs.values()}) == 1  # exact: the target's text
    assert outs["ar"].usage.model_extra["speculation"]["drafted"] == 0
    assert outs["draft:k=2"].usage.model_extra["speculation"]["method"] == "draft:k=2"
    assert outs["ar"].usage.model_extra["speculation"]["drafted_by"] is None
    spec = outs["ngram:k=4"].usage.model_extra["speculation"]  # what drafted, by source
    assert spec["drafted"] > 0 and spec["drafted_by"] == {"ngram": spec["drafted"]}


def test_models_and_health(client, base):
    assert [m.id for m in client.models.list().data] == [MODEL]
    info = health(base)
    assert info["status"] == "ok" and info["concurrency"] == 1
    assert "one request at a time" in info["note"]
    assert info["method"] == METHOD and "draft" in info["methods"]


# ---------------------------------------------------------------------- SSE framing
def test_sse_framing(base):
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 15, "temperature": 0, "stream": True, "token_sources": True}
    r = httpx.post(base + "/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and len(c["choices"]) == 1
               for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 15
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    tokens = [t for c in chunks for t in c.get("adaspec", {}).get("tokens", [])]
    assert len(tokens) == 15
    assert {source for _, source in tokens} <= {"accepted", "correction", "bonus", "plain"}
    assert tokens[0][1] == "plain"  # the prefill's token


# ---------------------------------------------------------------------- bad input
BAD = [
    ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "temperature": -0.5}, "temperature"),
    ({"prompt": PROMPT, "n": 9}, "n"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "seed": 2**70}, "seed"),  # beyond what a torch generator takes
    ({"prompt": PROMPT, "seed": -1}, "seed"),
    ({"prompt": PROMPT, "method": "warp:k=3"}, "method"),
    ({"prompt": PROMPT, "method": "draft:k=0"}, "method"),
    ({"prompt": PROMPT, "method": "draft:k=3@int8"}, "method"),
    ({"prompt": PROMPT, "method": "router:/etc/passwd"}, "method"),
    ({"prompt": PROMPT, "method": "draft:ctrl=disco,disco=/etc/passwd"}, "method"),
    ({"prompt": PROMPT, "method": "auto:profile=/etc/hostname"}, "method"),
    ({"prompt": PROMPT, "maxtokens": 5}, "maxtokens"),
    ({"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ({"prompt": PROMPT, "logprobs": True}, "logprobs"),  # a completion asks for a number
    ({"prompt": PROMPT, "top_logprobs": 2}, "logprobs"),  # a chat completion's field
    ({"prompt": PROMPT, "stop": [""]}, "stop"),
    ({"prompt": "x" * 300, "max_tokens": 5}, "prompt"),
    ({"prompt": PROMPT, "max_tokens": 250}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({}, "prompt"),
]


def test_every_bad_input_gets_its_error_and_others_are_not_disturbed(base, instance):
    with slowed(instance, 0.01), ThreadPoolExecutor(1) as pool:
        good = pool.submit(httpx.post, base + "/v1/completions", timeout=30,
                           json={"prompt": PROMPT, "max_tokens": 150, "temperature": 0})
        wait_until(lambda: health(base)["busy"])
        for body, param in BAD:
            r = httpx.post(base + "/v1/completions", json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"], body
            assert "\n" not in err["message"]
            if param:
                assert err["param"] == param, (body, err)
        assert health(base)["busy"], "the good request should still be decoding"
        answer = good.result()
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] == 150


def test_token_pieces_rebuild_the_text_across_multibyte_characters():
    from adaspec.serve.pieces import TokenPieces

    from .conftest import bpe_tokenizer

    tok = bpe_tokenizer()
    text = "déf añadir(a, b): return a + b  # ✓ 😀 ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) // 4  # byte-level pieces: some split a character
    cut = TokenPieces(tok)
    pieces = [cut.push(t) for t in ids]
    assert "".join(pieces) == tok.decode(ids) == text
    assert "" in pieces  # a token ending inside a character gives its text to the next one
    assert all("\ufffd" not in p for p in pieces)


def test_a_body_over_the_limit_gets_413(base):
    from adaspec.serve.app import MAX_BODY

    r = httpx.post(base + "/v1/completions", content=b" " * (MAX_BODY + 1),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "error" in r.json()


def test_a_server_without_a_draft_refuses_methods_that_need_one(model_dirs):
    inst = served_instance(model_dirs[0], None, method="ngram:k=4")
    with live_server(inst) as url:
        r = httpx.post(url + "/v1/completions",
                       json={"prompt": PROMPT, "max_tokens": 4, "method": "draft:k=2"})
        assert r.status_code == 400 and "needs a draft model" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions",
                       json={"prompt": PROMPT, "max_tokens": 4, "method": "ar"})
        assert r.status_code == 200
        assert health(url)["draft"] is None


def test_malformed_json_unknown_model_and_routes(base):
    r = httpx.post(base + "/v1/chat/completions", content=b'{"messages": [',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/chat/completions", json={"messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(base + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "tools": [{}]})
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"]
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
             "max_tokens": 6, "temperature": 0}
    plain = {**parts, "messages": [{"role": "user", "content": PROMPT}]}
    r = httpx.post(base + "/v1/chat/completions", json=parts)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == httpx.post(
        base + "/v1/chat/completions", json=plain).json()["choices"][0]["message"]["content"]
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    r = httpx.post(base + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": [image]}]})
    assert r.status_code == 400 and "text only" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", json={"model": "gpt-4", "prompt": PROMPT})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.get(base + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    assert r.status_code == 200


# ---------------------------------------------------------------------- queue and faults
def test_a_full_queue_answers_429_with_retry_after(instance):
    """The target's forward passes wait at a gate (not a delay), so the running request
    cannot end before the third one arrives."""
    with live_server(instance, max_queue=1) as url, ThreadPoolExecutor(2) as pool:
        body = {"prompt": PROMPT, "max_tokens": 80, "temperature": 0}
        with gated(instance):
            running = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=120)
            wait_until(lambda: health(url)["busy"])
            queued = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=120)
            wait_until(lambda: health(url)["queue_depth"] == 1)
            r = httpx.post(url + "/v1/completions", json=body)
            assert r.status_code == 429
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
        assert running.result().status_code == 200 and queued.result().status_code == 200
        assert metric(url, "adaspec_requests_total", status="429") == 1


def test_a_disconnect_cancels_within_a_step_and_frees_the_model(base, instance):
    delay = 0.05
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}
    whole = target_passes(base, instance, {**body, "stream": False})
    with slowed(instance, delay):
        with httpx.stream("POST", base + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert health(base)["busy"]
        gone = instance.target.calls  # closed after one chunk of 200
        wait_until(lambda: not health(base)["busy"], timeout=10)
        # counted in passes, not seconds: a slow machine notices later, never 80 passes late
        assert instance.target.calls - gone < whole // 2, (instance.target.calls - gone, whole)

        # a non-streaming client that gives up is cancelled as well
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", timeout=0.3,
                       json={"prompt": PROMPT, "max_tokens": 200, "temperature": 0})
        wait_until(lambda: not health(base)["busy"], timeout=10)
    # a client that gives up while its request waits in the queue leaves the queue; the
    # running one waits at a gate meanwhile, so it is still running whatever the timing
    with gated(instance), ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, base + "/v1/completions", timeout=60,
                              json={"prompt": PROMPT, "max_tokens": 30, "temperature": 0})
        wait_until(lambda: health(base)["busy"])
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", timeout=0.3,
                       json={"prompt": PROMPT, "max_tokens": 30, "temperature": 0})
        wait_until(lambda: health(base)["queue_depth"] == 0, timeout=10)
        assert health(base)["busy"]
        open_gate(instance)
        assert running.result().status_code == 200
    assert metric(base, "adaspec_generations_total", outcome="cancelled") >= 3
    r = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5})
    assert r.status_code == 200


def test_a_request_past_its_timeout_is_stopped(instance):
    """Stopped at its deadline, not after its 200 tokens: counted in the target's passes
    (each at least 20 ms here), so a slow machine cannot make it pass or fail."""
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0}
    with live_server(instance) as url:
        whole = target_passes(url, instance, body)
    with live_server(instance, timeout=0.4) as url, slowed(instance, 0.02):
        before = instance.target.calls
        r = httpx.post(url + "/v1/completions", timeout=10, json=body)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert instance.target.calls - before < whole // 2, (instance.target.calls - before)
        r = httpx.post(url + "/v1/completions", timeout=10, json={**body, "stream": True})
        events = sse_events(r)
        assert "timeout" in json.loads(events[-1])["error"]["code"]
        # one decoding and one waiting behind it: both stop at their deadline
        with ThreadPoolExecutor(1) as pool:
            before = instance.target.calls
            running = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=10)
            wait_until(lambda: health(url)["busy"])
            queued = httpx.post(url + "/v1/completions", json=body, timeout=10)
            assert queued.status_code == 504
            assert running.result().status_code == 504
        wait_until(lambda: not health(url)["busy"], timeout=10)
        assert instance.target.calls - before < whole  # the two together
        assert metric(url, "adaspec_generations_total", outcome="timeout") == 4
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 200


def test_an_api_key_is_required_when_set(instance, monkeypatch):
    openai = pytest.importorskip("openai")
    with live_server(instance, api_key="s3cret") as url:
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
        assert httpx.post(url + "/v1/completions", json={"prompt": PROMPT}).status_code == 401
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/health").status_code == 200  # liveness stays open
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).choices
        r = httpx.get(url + "/v1/models", headers={"X-API-Key": "s3cret"})
        assert r.status_code == 200


def test_metrics_count_requests_tokens_and_time_to_first_token(base):
    before = metric(base, "adaspec_generated_tokens_total")
    httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 7,
                                               "temperature": 0})
    assert metric(base, "adaspec_generated_tokens_total") == before + 7
    text = httpx.get(base + "/metrics").text
    for name in ("adaspec_requests_total", "adaspec_queue_depth", "adaspec_busy",
                 "adaspec_time_to_first_token_seconds_bucket", "adaspec_tokens_per_second",
                 "adaspec_accepted_tokens_total", "adaspec_drafted_tokens_total",
                 "adaspec_acceptance_rate", "adaspec_queue_wait_seconds"):
        assert name in text, name
    first_token_count = "adaspec_time_to_first_token_seconds_count"  # observations, not time
    assert metric(base, first_token_count, method="draft") >= 1


# ---------------------------------------------------------------------- the command
def test_serve_rejects_bad_flags_in_one_line(capsys):
    from adaspec.cli import main

    assert main(["serve", "--max-queue", "-1"]) == 2
    assert main(["serve", "--method", "warp"]) == 2
    assert main(["serve", "--max-batch", "0"]) == 2
    assert main(["serve", "--max-batch", "many"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("adaspec: error: ") for line in err)
    assert "--max-batch must be a whole number >= 1 or 'auto', got 'many'" in err[3]


def refused(url: str) -> bool:
    """No answer to a new connection: refused outright, or accepted from the backlog the
    moment before the listener closed and then reset without a response."""
    try:
        httpx.get(url + "/health", timeout=5)
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return True
    return False


def received(url: str) -> int:
    """Generation requests the server has taken: finished, decoding or queued."""
    h = health(url)
    decoding = h.get("running", int(bool(h["busy"])))
    return int(metric(url, "adaspec_generations_total")) + decoding + h["queue_depth"]


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(model_dirs):
    """The real command in a subprocess: it prints where it listens; after SIGTERM the
    requests in flight (decoding or queued) all finish, new connections are refused, and
    the process exits 0."""
    target, draft = model_dirs
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # ADASPEC_HOME: the module's
    proc = subprocess.Popen(
        [sys.executable, "-m", "adaspec", "serve", "--target", target, "--draft", draft,
         "--dtype", "float32", "--weights", "none", "--draft-weights", "none", "--method", "ar",
         "--port", "0", "--model-name", MODEL, "--log-level", "warning"],
        stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        line = ""
        deadline = time.monotonic() + 60
        while "listening on" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, line
            line = proc.stderr.readline()
        url = line.split("listening on ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        body = {"prompt": PROMPT, "max_tokens": 240, "temperature": 0}
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=60)
                       for _ in range(4)]
            # all four in, whichever are done, decoding or queued by now (a request arriving
            # after SIGTERM would rightly get 503)
            wait_until(lambda: received(url) == 4, timeout=20)
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: refused(url), timeout=20)  # new connections, while it drains
            answers = [f.result() for f in futures]
        assert [a.status_code for a in answers] == [200] * 4
        assert all(a.json()["usage"]["completion_tokens"] == 240 for a in answers)
        assert proc.wait(timeout=30) == 0
        assert "shutting down" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------- structured output
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_response_format_json_schema_is_the_engines_constrained_answer(client, instance):
    """`response_format` json_schema through the openai client, parsed into a pydantic
    model: the greedy answer is the library's constrained one, and it validates (the random
    tiny models write no JSON unconstrained)."""
    from pydantic import BaseModel, Field

    from adaspec.core.grammar import Grammar

    class Person(BaseModel):
        name: str = Field(max_length=8)
        age: int = Field(ge=0, le=120)

    messages = [{"role": "user", "content": "Who is it?"}]
    fmt = {"type": "json_schema",
           "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    expected = library_text(instance, messages, 60, chat=True,
                            grammar=Grammar.json_schema(PERSON))
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60,
                                         temperature=0, response_format=fmt)
    assert out.choices[0].message.content == expected
    assert out.choices[0].finish_reason == "stop"
    Person.model_validate_json(expected)
    parsed = client.chat.completions.parse(model=MODEL, messages=messages, max_tokens=60,
                                           temperature=0, response_format=Person)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120
    unconstrained = library_text(instance, messages, 60, chat=True)
    assert not unconstrained.lstrip().startswith("{")


def test_json_object_regex_and_grammar_constraints_stream_and_sample(base, instance):
    """Every constraint field, streamed, greedy and sampled: the text matches."""
    import re

    cases = [
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t),
                                                                             dict)),
        ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"guided_grammar": 'start: "yes" | "no"'}, lambda t: t in ("yes", "no")),
        ({"guided_json": PERSON}, lambda t: set(json.loads(t)) == {"name", "age"}),
    ]
    for extra, ok in cases:
        for temperature in (0, 0.9):
            body = {"messages": [{"role": "user", "content": "Answer."}], "max_tokens": 80,
                    "temperature": temperature, "seed": 3, "stream": True, **extra}
            with httpx.stream("POST", base + "/v1/chat/completions", json=body,
                              timeout=60) as r:
                assert r.status_code == 200, r.read()
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                           if e["choices"])
            finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
            assert finish == "stop" and ok(text), (extra, temperature, text)


def test_bad_constraints_are_400s_naming_them(base):
    def post(**extra):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **extra}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        return r.json()["error"]["message"]

    assert "JSON schema is not usable" in post(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert "needs" in post(response_format={"type": "json_schema", "json_schema": 3})
    assert "text, json_object or json_schema" in post(response_format={"type": "yaml"})
    assert "Lark grammar is not usable" in post(guided_grammar="start: (")
    assert "regular expression is not usable" in post(guided_regex="[a-")
    assert "give one constraint" in post(guided_regex="a", response_format={
        "type": "json_object"})
    assert "verified on chains" in post(guided_regex="a+", method="draft:tree=2x2")
    r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 4,
                                                   "guided_regex": "[ab]+"}, timeout=30)
    assert r.status_code == 200 and set(r.json()["choices"][0]["text"]) <= {"a", "b"}


def test_penalties_and_logit_bias_are_the_libraries_and_bad_ones_400(base, instance):
    from adaspec.core.sampling import SamplingParams

    engine = instance.engine(METHOD)
    banned = engine.generate(PROMPT, 1).token_ids[0]  # the greedy first token, then banned
    settings = {"presence_penalty": 1.0, "frequency_penalty": 0.5,
                "logit_bias": {str(banned): -100}}
    expected = engine.generate(PROMPT, 16, SamplingParams(
        presence_penalty=1.0, frequency_penalty=0.5, logit_bias=((banned, -100.0),)),
        chat=False)
    r = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 16,
                                                  "temperature": 0, **settings}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected.text
    assert banned not in expected.token_ids
    for bad, param in [({"logit_bias": {"x": 1}}, "logit_bias"),
                       ({"logit_bias": {"99999999": 1}}, "logit_bias"),
                       ({"logit_bias": {"1": 500}}, "logit_bias"),
                       ({"presence_penalty": 3}, "presence_penalty")]:
        r = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4,
                                                      **bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
