"""Router artifact: one file round-trips; a mismatch or a broken file is a clear error."""

from __future__ import annotations

import pytest
import torch

from adaspec.errors import InputError
from adaspec.route.artifact import RouterArtifact, load_artifact, save_artifact
from adaspec.route.policy import RouterPolicy

ARMS = {"ar": "ar", "ngram": "ngram", "draft:k=4": "draft:k=4"}


def make_artifact(dim: int = 8) -> RouterArtifact:
    torch.manual_seed(0)
    policy = RouterPolicy(dim, len(ARMS), hidden=16)
    policy.mean.normal_()
    policy.std.uniform_(0.5, 2)
    return RouterArtifact(ARMS, "tiny-target", 0.25, "measured", policy, {"prompts": 3})


def test_round_trip(tmp_path):
    art = make_artifact()
    path = save_artifact(art, tmp_path / "sub" / "router.pt")
    back = load_artifact(path)
    assert back.arms == ARMS and back.arm_names == list(ARMS)
    assert (back.target, back.alpha, back.cost, back.info) == ("tiny-target", 0.25, "measured",
                                                                {"prompts": 3})
    x = torch.randn(5, 8)
    assert torch.equal(back.policy.probs(x), art.policy.probs(x))


def test_mismatch_is_a_clear_error(tmp_path):
    back = load_artifact(save_artifact(make_artifact(), tmp_path / "r.pt"))
    back.check(target="tiny-target", arms=list(ARMS), alpha=0.25, hidden_size=8)
    with pytest.raises(InputError, match="trained for target 'tiny-target', not 'other'"):
        back.check(target="other")
    with pytest.raises(InputError, match="chooses among arms"):
        back.check(arms=["ar", "ngram"])
    with pytest.raises(InputError, match="alpha 0.25"):
        back.check(alpha=0.5)
    with pytest.raises(InputError, match="hidden size is 16"):
        back.check(hidden_size=16)


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(InputError, match="not found.*adaspec router train"):
        load_artifact(tmp_path / "none.pt")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(InputError, match="unreadable or corrupt"):
        load_artifact(bad)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    with pytest.raises(InputError, match="not an adaspec router artifact"):
        load_artifact(other)
    path = save_artifact(make_artifact(), tmp_path / "cut.pt")
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(InputError, match="corrupt"):
        load_artifact(path)
