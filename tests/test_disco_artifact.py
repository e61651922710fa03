"""The DISCO artifact: round trip, the pair check, and clear errors for bad files."""

from __future__ import annotations

import pytest
import torch

from adaspec.control.disco_artifact import DiscoArtifact
from adaspec.errors import InputError
from tests.disco_helpers import SPEC, artifact, stop_at_position


def test_round_trip(tmp_path):
    art = artifact(stop_at_position(3), tau=0.35, sl_max=5)
    art.provenance = {"data": {"suites": ["humaneval:2"]}, "train_prompts": ["x"]}
    art.metrics = {"val": {"rows": 3}}
    path = tmp_path / "a.pt"
    art.save(path)
    back = DiscoArtifact.load(path)
    assert (back.tau, back.sl_max, back.spec) == (0.35, 5, SPEC)
    assert (back.target, back.draft) == ("tiny-target", "tiny-draft")
    assert back.provenance == art.provenance and back.metrics == art.metrics
    x = torch.rand(20, SPEC.size) * 4
    torch.testing.assert_close(
        back.classifier.accept_probability(x), art.classifier.accept_probability(x)
    )


def test_the_weights_of_the_training_data_under_old_and_new_names():
    """Data collected before issue 32 named the weights `quant` / `draft_quant` and `fastest`
    `auto`; an artifact trained on it still loads its pair with those weights."""
    art = artifact(stop_at_position(2))
    assert art.weights == ("none", "none")  # collected before weights were recorded
    art.provenance = {"data": {"quant": "int8", "draft_quant": "auto"}}
    assert art.weights == ("int8", "fastest")
    art.provenance = {"data": {"weights": "ik", "draft_weights": "int4", "quant": "int8"}}
    assert art.weights == ("ik", "int4")


def test_another_pair_is_an_error():
    art = artifact(stop_at_position(2))
    art.check_pair("tiny-target", "tiny-draft")
    with pytest.raises(InputError, match="trained for draft 'tiny-draft'"):
        art.check_pair("tiny-target", "other-draft")


def test_bad_files(tmp_path):
    with pytest.raises(InputError, match="not found"):
        DiscoArtifact.load(tmp_path / "missing.pt")
    cut = tmp_path / "cut.pt"
    artifact(stop_at_position(2)).save(cut)
    cut.write_bytes(cut.read_bytes()[:100])
    with pytest.raises(InputError, match="not a readable"):
        DiscoArtifact.load(cut)
    broken = tmp_path / "broken.pt"
    torch.save({"format": "adaspec-disco-artifact", "version": 1, "spec": {}}, broken)
    with pytest.raises(InputError, match="malformed"):
        DiscoArtifact.load(broken)
    data = tmp_path / "data.pt"
    torch.save({"format": "adaspec-disco-data", "samples": []}, data)
    with pytest.raises(InputError, match="not a DISCO artifact"):
        DiscoArtifact.load(data)
