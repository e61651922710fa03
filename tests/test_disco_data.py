"""DISCO data collection on tiny models: labels are the draft's argmax against the target's
greedy token given the true prefix; splits by prompt; the file round-trips."""

from __future__ import annotations

import pytest
import torch

from adaspec.control.disco_features import FeatureSpec, distribution_features
from adaspec.core.sampling import SamplingParams
from adaspec.errors import InputError
from adaspec.lab.bench.suites import Prompt
from adaspec.lab.disco.dataset import DiscoData, assign_splits, collect, rows
from adaspec.methods.build import build_generator
from tests.test_engine import reference_greedy

PROMPT_IDS = {"p/0": [5, 9, 13, 2], "p/1": [17, 3, 3, 3, 40], "p/2": [1, 2, 3, 4, 5, 6]}
PROMPTS = [("toy", Prompt(pid, "cat", "")) for pid in PROMPT_IDS]


@pytest.fixture
def data(target, draft):
    engine = build_generator("ngram", target, None, eos_token_ids=[])

    def generate(prompt):
        ids = PROMPT_IDS[prompt.id]
        return ids, engine.generate(ids, 16, SamplingParams()).token_ids

    splits = {"p/0": "train", "p/1": "val", "p/2": "test"}
    return collect(PROMPTS, generate, draft, splits, {"target": "t", "draft": "d"}, False)


def test_labels_are_draft_argmax_equals_target_token(data, target_model, draft_model):
    for s in data.samples:
        assert s.output == reference_greedy(target_model, s.prompt_ids, 16)
        for i, tok in enumerate(s.output):
            prefix = torch.tensor([s.prompt_ids + s.output[:i]])
            with torch.no_grad():
                logits = draft_model(prefix).logits[0, -1]
            assert bool(s.hits[i]) == (int(logits.argmax()) == tok)
            torch.testing.assert_close(s.dist[i], distribution_features(logits), atol=1e-5, rtol=0)
    assert any(bool(s.hits.any()) for s in data.samples)  # the tiny pair agrees sometimes


def test_file_round_trip_and_rows(data, tmp_path):
    path = tmp_path / "d.pt"
    data.save(path)
    back = DiscoData.load(path)
    assert [s.prompt_id for s in back.samples] == ["p/0", "p/1", "p/2"]
    assert back.provenance["tokens"] == 48 and back.provenance["target"] == "t"
    assert back.provenance["splits"]["val"] == ["p/1"]
    torch.testing.assert_close(back.samples[1].dist, data.samples[1].dist)
    x, y, pos = rows(back.split("train"), FeatureSpec())
    assert x.shape == (15, FeatureSpec().size)  # token 0 (the prefill's) is left out
    assert y.tolist() == back.samples[0].hits[1:].tolist()
    assert x[:, -1].tolist() == pos.float().tolist()


def test_bad_files(tmp_path):
    with pytest.raises(InputError, match="not found"):
        DiscoData.load(tmp_path / "nope.pt")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(InputError, match="not a readable"):
        DiscoData.load(junk)
    torch.save({"format": "something else"}, tmp_path / "other.pt")
    with pytest.raises(InputError, match="not a DISCO data file"):
        DiscoData.load(tmp_path / "other.pt")


def test_splits_are_by_prompt_per_category_and_seeded():
    prompts = [("s", Prompt(f"a/{i}", "a", "")) for i in range(10)]
    prompts += [("s", Prompt(f"b/{i}", "b", "")) for i in range(3)]
    prompts += [("s", Prompt("c/0", "c", ""))]
    splits = assign_splits(prompts, [0.6, 0.2, 0.2], seed=1)
    assert set(splits) == {p.id for _, p in prompts}
    a = [splits[f"a/{i}"] for i in range(10)]
    assert a.count("val") == 2 and a.count("test") == 2
    assert sorted(splits[f"b/{i}"] for i in range(3)) == ["test", "train", "val"]
    assert splits["c/0"] == "train"
    assert assign_splits(prompts, [0.6, 0.2, 0.2], seed=1) == splits
    assert assign_splits(prompts, [0.6, 0.2, 0.2], seed=2) != splits
    with pytest.raises(InputError):
        assign_splits(prompts, [0.5, 0.5, 0.5])
