"""Counting target tokens in bench results, choosing the top N, and the stored set's checks."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from adaspec.errors import InputError, ModelStoreError
from adaspec.lab.bench.token_counts import count_target_outputs
from adaspec.store.token_set import (
    TokenSet,
    load_token_set,
    save_token_set,
    token_set_path,
    top_tokens,
)


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def write_results(folder: Path, rows: list[dict], target: str = "tgt") -> Path:
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"settings": {"target": target}}))
    path = folder / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"cut off')
    return path


def row(pid: str, method: str, ids: list[int]) -> dict:
    return {"prompt_id": pid, "method": method, "token_ids": ids}


def test_counts_plain_decoding_once_per_output(tmp_path):
    a = write_results(
        tmp_path / "a",
        [row("p/0", "ar", [5, 6, 7, 5]), row("p/0", "draft:k=4", [9, 9, 9]),
         row("p/1", "ar", [1, 2]), row("p/2", "ar", [3, 3])],
    )
    b = write_results(
        tmp_path / "b",
        # p/0 again, a longer run of the same decoding: counted once, the longer one
        [row("p/0", "ar", [5, 6, 7, 5, 8]), row("p/1", "llamacpp", [1, 4])],
    )
    other = write_results(tmp_path / "c", [row("p/9", "ar", [50, 50])], target="smollm")
    counts, info = count_target_outputs([a, b, other], "tgt", exclude_prompts=["p/2"])
    assert counts == Counter({5: 2, 6: 1, 7: 1, 8: 1, 1: 2, 2: 1, 4: 1})
    assert info["outputs"] == 3 and info["prompts"] == 2 and info["excluded_prompts"] == ["p/2"]
    assert info["sources"][2]["skipped"] == "target smollm"
    assert len(info["sources"][0]["sha256"]) == 64
    with pytest.raises(InputError, match="not found"):
        count_target_outputs([tmp_path / "nope.jsonl"], "tgt")


def test_top_tokens_specials_then_counts_then_lowest_ids():
    counts = Counter({40: 5, 30: 5, 20: 1, 99: 7})
    assert top_tokens(counts, 4, 100, special_ids=[98]) == [30, 40, 98, 99]
    # ties by lower id; the rest filled from the lowest unseen ids
    assert top_tokens(counts, 8, 100, special_ids=[98]) == [0, 1, 2, 20, 30, 40, 98, 99]
    with pytest.raises(InputError, match="no room"):
        top_tokens(counts, 1, 100, special_ids=[98])
    with pytest.raises(InputError, match="exceeds"):
        top_tokens(counts, 101, 100, special_ids=[])


def test_round_trip_and_checks(home):
    ts = TokenSet("drf", (1, 5, 9), {"tokens": 3})
    path = save_token_set(ts)
    assert path == token_set_path("drf", 3) and path.parent.name == "drf.vocab"
    assert load_token_set("drf", 3, vocab_size=10) == ts
    with pytest.raises(ModelStoreError, match="restrict-vocab --draft drf --top 4"):
        load_token_set("drf", 4)
    with pytest.raises(ModelStoreError, match="outside the draft's vocabulary"):
        load_token_set("drf", 3, vocab_size=8)
    body = json.loads(path.read_text())
    body["token_ids"][0] = 2  # an edited file no longer matches its checksum
    path.write_text(json.dumps(body))
    with pytest.raises(ModelStoreError, match="corrupt"):
        load_token_set("drf", 3)
