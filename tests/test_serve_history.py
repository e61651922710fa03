"""`adaspec serve` and the cross-request history: learned from each finished request, saved
every N requests and at shutdown under $ADASPEC_HOME, reloaded at start, `--history off`."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="needs httpx: pip install -e '.[serve]'")

from adaspec.backends.load import load_backends  # noqa: E402
from adaspec.draft.history import HistoryIndex  # noqa: E402
from adaspec.methods.build import build_generator  # noqa: E402
from adaspec.serve.history import ServedHistory, default_path  # noqa: E402
from adaspec.serve.instance import ModelInstance  # noqa: E402

from .test_serve import PROMPT, live_server, wait_until  # noqa: E402

METHOD = "auto:use=history,profile=flat"


@pytest.fixture
def loaded(model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path))
    target, tokenizer, _, eos = load_backends(model_dirs[0], None, "float32", "none", "none")
    return target, tokenizer, eos


def complete(base: str) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    return httpx.post(base + "/v1/completions", json=body, timeout=60).json()


def test_the_server_learns_saves_and_reloads_its_history(loaded, tmp_path):
    target, tokenizer, eos = loaded
    kept = ServedHistory.open("", target, tokenizer, every=2)
    assert kept.path == default_path(target.name) and kept.path.parent == tmp_path / "history"
    instance = ModelInstance(target, tokenizer, None, eos, METHOD, history=kept)
    with live_server(instance) as base:
        first, second = complete(base), complete(base)
        # learned as each request ended (the worker does it right after the answer)
        wait_until(lambda: kept.index.requests == 2)
        wait_until(kept.path.is_file)  # saved after --history-every requests
        third = complete(base)
        wait_until(lambda: kept.index.requests == 3)
        held = httpx.get(base + "/health", timeout=10).json()["history"]
        assert held == {"tokens": kept.index.tokens, "budget": kept.index.budget,
                        "documents": 3} and held["tokens"] > 0
    texts = {r["choices"][0]["text"] for r in (first, second, third)}
    assert len(texts) == 1  # greedy: the same answer, with or without history drafts
    spec = [r["usage"]["speculation"] for r in (first, second, third)]
    assert spec[0]["drafted"] == 0 and spec[1]["accepted"] > 0 and spec[2]["accepted"] > 0
    saved = HistoryIndex.load(kept.path, kept.index.tokenizer, target.vocab_size)
    assert saved.requests == 0 and saved.documents == 2  # the third is not saved yet
    instance.close()  # ... it is at shutdown
    restarted = ServedHistory.open("", target, tokenizer)
    assert restarted.index.documents == 3 and restarted.index.tokens == kept.index.tokens
    context = kept.index._docs[0][:10].tolist()
    assert restarted.index.lookup(context, 4) == kept.index.lookup(context, 4)
    assert restarted.index.lookup(context, 4).tokens


def test_history_off_and_elsewhere(loaded, tmp_path, capsys):
    target, tokenizer, eos = loaded
    off = ServedHistory.open("off", target, tokenizer, every=1)
    instance = ModelInstance(target, tokenizer, None, eos, METHOD, history=off)
    engine = instance.default_engine
    engine.generate(PROMPT, 8, chat=False)
    instance.request_done(engine)
    assert off.path is None and off.index.documents == 1
    assert not (tmp_path / "history").exists()  # nothing written
    unused = ServedHistory.open("", target, tokenizer, every=1)  # no method drafts from it
    instance = ModelInstance(target, tokenizer, None, eos, "ar", history=unused)
    instance.default_engine.generate(PROMPT, 8, chat=False)
    instance.request_done(instance.default_engine)
    instance.close()
    assert not (tmp_path / "history").exists()  # nothing learned: nothing written
    elsewhere = tmp_path / "mine" / "h.bin"
    kept = ServedHistory.open(str(elsewhere), target, tokenizer, every=1)
    instance = ModelInstance(target, tokenizer, None, eos, METHOD, history=kept)
    instance.default_engine.generate(PROMPT, 8, chat=False)
    instance.request_done(instance.default_engine)
    assert elsewhere.is_file()
    elsewhere.write_bytes(elsewhere.read_bytes()[:-1])  # damaged: reported, then ignored
    again = ServedHistory.open(str(elsewhere), target, tokenizer)
    err = capsys.readouterr().err.strip().splitlines()
    assert again.index.tokens == 0 and len(err) == 1
    assert err[0].startswith(f"adaspec serve: history file {elsewhere} is truncated")


def test_the_history_flags_are_checked_before_any_model_loads(capsys):
    from adaspec.cli import main

    for flag in ("--history-every", "--history-tokens"):
        assert main(["serve", flag, "0"]) == 2
        assert f"{flag} must be >= 1" in capsys.readouterr().err


def test_a_servers_slots_learn_one_methods_estimates_together(loaded):
    """Every request gets an engine of its own (its drafter's state is its alone), and the
    engines of one method share what it learns across requests (`AutoMemory`): a request on
    one slot moves the history's estimates every slot prices with; engines built apart learn
    apart (the control)."""
    target, tokenizer, eos = loaded
    kept = ServedHistory.open("off", target, tokenizer)
    method = METHOD  # the server's own (a file-naming parameter is the server's choice)
    instance = ModelInstance(target, tokenizer, None, eos, method, history=kept)
    instance.open_slots(2)
    first, second = (instance.request_engine(method, i) for i in (0, 1))
    assert first.drafter.memory is second.drafter.memory is \
        instance.engine(method).drafter.memory
    again = instance.request_engine(method, 0)  # the next request on slot 0
    assert again is not first and again.drafter is not first.drafter
    assert again.target is first.target is instance.slots[0][0]
    assert again.drafter.memory is first.drafter.memory
    apart = build_generator(method, instance.slots[1][0], tokenizer, None, eos_token_ids=eos,
                         history=kept.index)
    assert apart.drafter.memory is not first.drafter.memory
    before = {c: r.trials for c, r in second.drafter.memory.history_rates.items()}
    for _ in range(3):  # the history holds the answer after the first; later steps credit it
        first.generate(PROMPT, max_new_tokens=24)
        first.request_done()
    moved = {c for c, r in second.drafter.memory.history_rates.items() if r.trials != before[c]}
    assert moved and second.drafter.memory.history_outcomes[0] > 0
    assert not any(r.trials for r in apart.drafter.memory.history_rates.values())
    instance.close()
