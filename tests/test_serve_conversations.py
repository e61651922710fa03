"""A conversation's cache kept between its turns (`adaspec serve --max-batch N`, tiny models
on the static runtime, which keeps a sequence's prefix): the next turn prefills only what it
adds (its usage says how many prompt tokens the cache held) and answers what a server that
never saw the conversation answers; idle slots beyond the batch keep more conversations than
decode at once; room is made least recently used first, and /health and /metrics say so."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from adaspec.backends.load import load_backends  # noqa: E402
from adaspec.serve.instance import ModelInstance  # noqa: E402

from .test_serve import adaspec_home, live_server  # noqa: E402, F401  (the module's fixture)

OPENINGS = ["def add(a, b):", "class Point:", "import os\n", "x = [1, 2, 3]\nfor",
            "def fibonacci(n):", "while True:"]


@pytest.fixture(scope="module")
def static_dirs(model_dirs):  # after the autouse adaspec_home
    return model_dirs


def _instance(model_dirs, method: str = "ar") -> ModelInstance:
    target, tokenizer, draft, eos = load_backends(model_dirs[0], None, "float32", "static",
                                                  "none")
    return ModelInstance(target, tokenizer, draft, eos, method)


def complete(url: str, prompt: str, method: str = "ar", n: int = 12) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": n, "temperature": 0, "method": method})
    assert r.status_code == 200, r.text
    return r.json()


def turns(url: str, opening: str, n_turns: int = 3, method: str = "ar") -> list[dict]:
    """Each turn resends the conversation so far (its prompts and answers) plus a line."""
    out, text = [], opening
    for t in range(n_turns):
        got = complete(url, text, method)
        out.append(got)
        text += got["choices"][0]["text"] + f"\n# turn {t + 2}\n"
    return out


def cached(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def held_prefix(instance: ModelInstance, before: str, after: str) -> int:
    """Prompt tokens of `after` a cache holding prompt `before` keeps at least: their common
    start (re-tokenized text may merge across the turn's boundary: reuse stops there)."""
    from adaspec.backends.base import common_prefix

    a, b = instance.encode(before, chat=False), instance.encode(after, chat=False)
    return min(common_prefix(a, b), len(b) - 1)


def test_a_conversations_next_turn_prefills_only_what_it_adds(static_dirs):
    """Each turn keeps what the cache holds of it: the previous turn's prompt and answer as
    generated (its last token emitted, never fed), up to where the resent text tokenizes
    otherwise; the answers are those of a server that computes every prompt afresh."""
    from adaspec.backends.base import common_prefix
    from adaspec.core.sampling import SamplingParams

    instance = _instance(static_dirs)
    # what the cache holds after each turn, from the engine alone (greedy: what is served)
    engine = instance.engine("ar")
    held, text = [], OPENINGS[0]
    for t in range(3):
        ids = instance.encode(text, chat=False)
        result = engine.generate(ids, 12, SamplingParams(temperature=0.0), chat=False)
        held.append((ids, ids + result.token_ids[:-1], result.text))
        text += result.text + f"\n# turn {t + 2}\n"
    instance.target.reset()
    with live_server(instance, max_batch=2) as url:
        served = turns(url, OPENINGS[0])
        assert cached(served[0]) == 0
        kept_answer = 0
        for t in (1, 2):
            ids = held[t][0]
            want = min(common_prefix(held[t - 1][1], ids), len(ids) - 1)
            assert want >= len(held[t - 1][0])  # the whole previous prompt
            kept_answer += want - len(held[t - 1][0])
            assert cached(served[t]) == want, t
        assert kept_answer > 0  # and what the answers' text gives back of their tokens
        assert [s["choices"][0]["text"] for s in served] == [h[2] for h in held]
        h = httpx.get(url + "/health").json()["prefix_cache"]
        assert h["kept"] >= 1 and h["kept_tokens"] > served[2]["usage"]["prompt_tokens"]
        metrics = httpx.get(url + "/metrics").text
        assert 'adaspec_prompt_tokens_cached_total{method="ar"}' in metrics
        assert "adaspec_prefix_cache_kept_tokens" in metrics
    instance.close()
    # the same turns on a server that computes every prompt from scratch (one slot, the
    # cache emptied after each turn): the same answers
    fresh = _instance(static_dirs)
    with live_server(fresh, max_batch=1) as url:
        text = OPENINGS[0]
        for t, got in enumerate(served):
            alone = complete(url, text)
            assert cached(alone) == 0
            assert alone["choices"][0]["text"] == got["choices"][0]["text"], t
            text += got["choices"][0]["text"] + f"\n# turn {t + 2}\n"
            fresh.target.reset()  # nothing kept for the next turn
    fresh.close()


def test_idle_slots_keep_more_conversations_than_decode_at_once(static_dirs):
    """Two decoding at once, six kept: four conversations, interleaved turn by turn, each
    find their earlier turns in the cache, and answer what each answers served alone."""
    instance = _instance(static_dirs, "ngram:k=3")
    with live_server(instance, max_batch=2, cache_slots=6) as url:
        texts = {o: o for o in OPENINGS[:4]}
        got: dict[str, list[dict]] = {o: [] for o in texts}
        for t in range(3):
            with ThreadPoolExecutor(2) as pool:  # two at a time, in turn order
                answers = list(pool.map(lambda o: complete(url, texts[o], "ngram:k=3"),
                                        list(texts)))
            for o, answer in zip(texts, answers, strict=True):
                if t:  # at least its previous turn's prompt
                    before = texts[o][: texts[o].rindex("\n# turn")]
                    before = before[: len(before) - len(got[o][-1]["choices"][0]["text"])]
                    assert cached(answer) >= held_prefix(instance, before, texts[o]), (o, t)
                got[o].append(answer)
                texts[o] += answer["choices"][0]["text"] + f"\n# turn {t + 2}\n"
        assert httpx.get(url + "/health").json()["prefix_cache"]["evicted"] == 0
    instance.close()
    for opening in texts:  # each conversation alone
        alone = _instance(static_dirs, "ngram:k=3")
        with live_server(alone, max_batch=2) as url:
            for t, answer in enumerate(turns(url, opening, method="ngram:k=3")):
                assert answer["choices"][0]["text"] == got[opening][t]["choices"][0]["text"]
        alone.close()


def test_the_least_recently_used_conversation_makes_room(static_dirs):
    """Two slots, three conversations: the third takes the slot used longest ago (the
    first's), so the second conversation's next turn finds its turn and the first's starts
    from scratch (taking the slot of the third, now the least recently used)."""
    instance = _instance(static_dirs)
    with live_server(instance, max_batch=2, cache_slots=2) as url:
        a = complete(url, OPENINGS[0])
        b = complete(url, OPENINGS[1])
        complete(url, OPENINGS[2])
        b2 = complete(url, OPENINGS[1] + b["choices"][0]["text"] + "\n# more\n")
        a2 = complete(url, OPENINGS[0] + a["choices"][0]["text"] + "\n# more\n")
        assert cached(b2) >= held_prefix(instance, OPENINGS[1], OPENINGS[1] + b["choices"][0]
                                         ["text"] + "\n# more\n") > 0
        assert cached(a2) == 0
        assert httpx.get(url + "/health").json()["prefix_cache"]["evicted"] == 2
    instance.close()


def test_cache_prompt_false_prefills_the_whole_prompt_afresh(static_dirs):
    """llama-server's `cache_prompt: false`: a repeated prompt reuses nothing its slot kept
    (a benchmark's cold request) and answers the same; the default reuses it."""
    instance = _instance(static_dirs)
    with live_server(instance, max_batch=2, cache_slots=2) as url:
        first = complete(url, OPENINGS[3])
        warm = complete(url, OPENINGS[3])
        cold = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": OPENINGS[3], "max_tokens": 12, "temperature": 0, "method": "ar",
            "cache_prompt": False}).json()
        assert cached(warm) > 0 and cached(cold) == 0
        assert cold["choices"][0]["text"] == warm["choices"][0]["text"] \
            == first["choices"][0]["text"]
        bad = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": "x", "max_tokens": 2, "cache_prompt": "no"})
        assert bad.status_code == 400 and "cache_prompt" in bad.text
    instance.close()
