"""`adaspec serve --max-batch N` on tiny models over loopback: concurrent requests decoded
together answer what each gets served alone (greedy, mixed methods, lengths, stops and
arrivals), a seeded sampled answer does not depend on its companions, a client leaving
mid-batch stops only its own request, and the queue limits and health still hold."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from .test_serve import (  # noqa: E402, F401  (adaspec_home: this module's fixture too)
    PROMPT,
    adaspec_home,
    gated,
    health,
    live_server,
    served_instance,
    wait_until,
)

PROMPTS = [PROMPT, "class Point:", "def fibonacci(n):", "x = [1, 2, 3]\nfor",
           "import os\n", "def add(a, b):\n    return"]
METHODS = ["draft:k=3", "ngram:k=4", "ar", "draft:k=5", "auto", "ngram:k=2"]


@pytest.fixture(scope="module")
def instance(model_dirs):  # after the autouse adaspec_home
    inst = served_instance(*model_dirs)
    yield inst
    inst.close()


def body(i: int, n: int = 24, **extra) -> dict:
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": n, "temperature": 0,
            "method": METHODS[i % len(METHODS)], **extra}


def alone(url: str, b: dict) -> dict:
    r = httpx.post(url + "/v1/completions", json=b, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_concurrent_requests_answer_what_they_get_alone(instance):
    bodies = [body(i, n=10 + 5 * i) for i in range(6)]
    bodies.append(body(0, stop=["\n"]))
    bodies.append(body(1, n=3))
    with live_server(instance, max_batch=4) as url:
        want = [alone(url, b)["choices"][0] for b in bodies]  # one at a time
        with ThreadPoolExecutor(len(bodies)) as pool:
            got = list(pool.map(lambda b: alone(url, b)["choices"][0], bodies))
        h = health(url)
    assert [g["text"] for g in got] == [w["text"] for w in want]
    assert [g["finish_reason"] for g in got] == [w["finish_reason"] for w in want]
    assert h["max_batch"] == 4 and h["concurrency"] == 4
    assert h["note"].startswith("4 requests decoded together")


def test_constrained_requests_decoded_together_answer_what_they_get_alone(instance):
    """Requests under a grammar beside unconstrained ones: each answer is its own alone
    (greedy and seeded sampled), and the constrained ones match their grammar."""
    import json
    import re

    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 999,
                                                     "minimum": 0},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    bodies = [body(0, n=30, guided_json=schema), body(1, n=20),
              body(2, n=16, guided_regex="[a-f]{4}-[0-9]{3}"),
              body(3, n=30, guided_json=schema, temperature=0.8, seed=5),
              body(4, n=24), body(5, n=12, guided_grammar='start: "yes" | "no"')]
    with live_server(instance, max_batch=4) as url:
        want = [alone(url, b)["choices"][0] for b in bodies]
        with ThreadPoolExecutor(len(bodies)) as pool:
            got = list(pool.map(lambda b: alone(url, b)["choices"][0], bodies))
    assert [g["text"] for g in got] == [w["text"] for w in want]
    for i in (0, 3):
        assert set(json.loads(got[i]["text"])) == {"n", "ok"}
    assert re.fullmatch("[a-f]{4}-[0-9]{3}", got[2]["text"])
    assert got[5]["text"] in ("yes", "no")


def test_n_answers_are_each_the_answer_alone_with_its_seed(instance):
    """`n` > 1: answer i is the request alone with seed + i (decoded together, the prompt
    prefilled once); greedy answers are all the one; usage counts every answer; streamed,
    the chunks carry their answer's index."""
    import json

    prompt = {"prompt": PROMPTS[2], "max_tokens": 12, "method": "draft:k=3"}
    with live_server(instance, max_batch=4) as url:
        many = alone(url, {**prompt, "n": 3, "temperature": 0.9, "seed": 11})
        each = [alone(url, {**prompt, "temperature": 0.9, "seed": 11 + i})["choices"][0]
                for i in range(3)]
        greedy = alone(url, {**prompt, "n": 2, "temperature": 0})
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert [c["text"] for c in many["choices"]] == [c["text"] for c in each]
    assert len({c["text"] for c in many["choices"]}) > 1  # different draws
    assert many["usage"]["completion_tokens"] == 36
    assert many["usage"]["total_tokens"] == many["usage"]["prompt_tokens"] + 36
    assert greedy["choices"][0]["text"] == greedy["choices"][1]["text"]
    # streamed: the answers' chunks interleaved by index, each one whole, usage summed
    body = {**prompt, "n": 3, "temperature": 0.9, "seed": 11, "stream": True,
            "stream_options": {"include_usage": True}}
    with live_server(instance, max_batch=4) as url, \
            httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    texts = ["".join(e["choices"][0]["text"] for e in events
                     if e["choices"] and e["choices"][0]["index"] == i) for i in range(3)]
    assert texts == [c["text"] for c in each]
    finishes = [e["choices"][0]["index"] for e in events
                if e["choices"] and e["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 36


def test_a_seeded_answer_ignores_its_companions(instance):
    seeded = {"prompt": PROMPT, "max_tokens": 20, "temperature": 1.0, "seed": 11,
              "method": "draft:k=3"}
    with live_server(instance, max_batch=4) as url:
        first = alone(url, seeded)["choices"][0]["text"]
        with ThreadPoolExecutor(4) as pool:
            others = [pool.submit(alone, url, body(i, n=30)) for i in range(3)]
            again = pool.submit(alone, url, seeded)
            assert again.result()["choices"][0]["text"] == first
            for o in others:
                o.result()


def test_a_client_leaving_mid_batch_stops_only_its_request(instance):
    with live_server(instance, max_batch=4) as url:
        want = [alone(url, body(i, n=40)) for i in range(3)]
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(alone, url, body(i, n=40)) for i in range(3)]
            stream = {**body(3, n=200), "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=stream, timeout=30) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
            got = [f.result() for f in futures]
        assert [g["choices"][0]["text"] for g in got] == [w["choices"][0]["text"]
                                                          for w in want]
        wait_until(lambda: health(url)["running"] == 0, timeout=10)
        r = httpx.post(url + "/v1/completions", json=body(0, n=4), timeout=30)
        assert r.status_code == 200


def state(url: str) -> tuple[int, int]:
    """(requests running, requests waiting) as /health says."""
    h = health(url)
    return h["running"], h["queue_depth"]


def test_the_queue_behind_a_full_batch_answers_429(instance):
    """Two requests decoding and one waiting fill `max_batch=2, max_queue=1`: a fourth gets
    429 with Retry-After, and the three still finish. The target's forward passes are held
    by a gate, not slowed, so no request can end before the fourth arrives."""
    with live_server(instance, max_batch=2, max_queue=1) as url, \
            ThreadPoolExecutor(4) as pool:
        alone(url, body(0, n=2))  # the worker started and the batch cost known, gate open
        with gated(instance) as gate:
            running = [pool.submit(httpx.post, url + "/v1/completions", json=body(i, n=20),
                                   timeout=120) for i in range(3)]
            # the worker admits what has arrived (one or two requests) and waits at the gate
            wait_until(lambda: state(url) in ((1, 2), (2, 1)), timeout=20)
            if state(url) == (1, 2):
                gate.release()  # the one prefill: the worker then admits a second request
                wait_until(lambda: state(url) == (2, 1), timeout=20)
            r = httpx.post(url + "/v1/completions", json=body(0, n=5))
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert all(f.result().status_code == 200 for f in running)


def test_a_runtime_with_one_sequence_is_named(model_dirs):
    from adaspec.backends.sequences import sequences
    from adaspec.errors import InputError

    class OneSequence:
        kind = "llamacpp"

    with pytest.raises(InputError, match="keeps one sequence.*ik_llama.cpp"):
        sequences(OneSequence(), 2)  # type: ignore[arg-type]


def test_serve_batches_by_default_where_the_runtime_does(model_dirs):
    """`adaspec serve` without --max-batch: AUTO_SLOTS slots where the target's runtime
    decodes several requests in one call (ik_llama.cpp, the static runtime), one request at a
    time where it runs them in turn; a method's own `@weights` decides."""
    from adaspec.backends.runtimes import RUNTIMES, fastest_weights
    from adaspec.serve.config import AUTO_SLOTS, ServeConfig, auto_max_batch
    from adaspec.store.catalog import TARGET_DEFAULT

    target, _ = model_dirs
    assert auto_max_batch("ar", target, "none", "cpu") == 1
    assert auto_max_batch("ar", target, "static", "cpu") == AUTO_SLOTS
    assert auto_max_batch("ar@static", target, "none", "cpu") == AUTO_SLOTS
    assert auto_max_batch("ar@none", target, "static", "cpu") == 1
    assert auto_max_batch("ar", target, "fastest", "cpu") == 1  # a torch directory
    assert {r.name for _, r in RUNTIMES.items() if r.batches} == {"ik_llama.cpp", "torch-static"}
    if fastest_weights(TARGET_DEFAULT, "cpu") == "ik":  # the built-in pair, installed
        assert auto_max_batch("auto", TARGET_DEFAULT, "fastest", "cpu") == AUTO_SLOTS
    assert ServeConfig(max_batch=AUTO_SLOTS).slots() == f"{AUTO_SLOTS} requests decoded together"
    assert ServeConfig().slots() == "one request at a time"


@pytest.mark.parametrize("flags, slots", [
    (["--weights", "static"], 4), (["--weights", "none"], 1),
    (["--weights", "static", "--max-batch", "1"], 1),
    (["--weights", "none", "--max-batch", "3"], 3),
    (["--weights", "none", "--method", "ar@static", "--max-batch", "auto"], 4)])
def test_the_serve_command_starts_the_slots_it_resolves(model_dirs, monkeypatch, flags, slots):
    import adaspec.serve.server
    from adaspec.cli import main

    started = []
    monkeypatch.setattr(adaspec.serve.server, "run",
                        lambda config, log_level: started.append(config) or 0)
    target, draft = model_dirs
    assert main(["serve", "--target", target, "--draft", draft, "--device", "cpu", *flags]) == 0
    assert [c.max_batch for c in started] == [slots]


def test_the_metrics_count_the_batched_rounds(instance):
    """/metrics says where the batch's time went: rounds and their call seconds by kind
    (prefill or decode), the tokens they scored, and the requests per call."""
    from .test_serve import metric

    bodies = [{**body(i, n=6 + 3 * i), "method": "ar"} for i in range(4)]
    with live_server(instance, max_batch=4) as url:
        with ThreadPoolExecutor(len(bodies)) as pool:
            got = list(pool.map(lambda b: alone(url, b), bodies))
        rounds = {k: metric(url, "adaspec_batch_rounds_total", kind=k)
                  for k in ("prefill", "decode")}
        seconds = {k: metric(url, "adaspec_batch_round_seconds_total", kind=k)
                   for k in ("prefill", "decode")}
        prompt = metric(url, "adaspec_batch_tokens_total", part="prompt")
        step = metric(url, "adaspec_batch_tokens_total", part="step")
        calls = metric(url, "adaspec_batch_requests_count")
        most = metric(url, "adaspec_batch_requests_bucket", le="+Inf")
    assert rounds["prefill"] >= 1 and rounds["decode"] >= 1
    assert seconds["prefill"] > 0 and seconds["decode"] > 0
    assert calls == most == rounds["prefill"] + rounds["decode"]
    # a request's first token comes from its prompt's last row, each later one from a step
    assert step == sum(g["usage"]["completion_tokens"] - 1 for g in got)
    assert 0 < prompt <= sum(g["usage"]["prompt_tokens"] for g in got)



@pytest.mark.parametrize("max_batch", [1, 4])
def test_the_worker_offers_a_trim_after_each_request_or_round(instance, monkeypatch, max_batch):
    """Both workers (FIFO and batched) give freed memory back between units of work
    (`backends/memory.Trimmer`, which decides whether it is time)."""
    from adaspec.backends.memory import Trimmer

    offered: list[int] = []
    monkeypatch.setattr(Trimmer, "maybe", lambda self: offered.append(1) or False)
    with live_server(instance, max_batch=max_batch) as url:
        alone(url, body(2, n=8))
        wait_until(lambda: len(offered) >= 1)
