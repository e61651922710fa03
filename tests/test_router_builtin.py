"""The router policy shipped for the built-in pair (`route/builtin`): it loads, it is for the
built-in target and its hidden size, it says where it came from, it decides (an arm for
every prompt state, the same one for the same state), and `router` without a path uses it."""

from __future__ import annotations

import json

import torch

from adaspec.methods.spec import parse_method
from adaspec.route.artifact import load_artifact
from adaspec.route.builtin import ROUTER_BUILTIN
from adaspec.store.catalog import TARGET_DEFAULT

HIDDEN = 1536  # Qwen2.5-Coder-1.5B


def test_the_shipped_policy_is_for_the_built_in_target_with_its_provenance():
    assert ROUTER_BUILTIN.is_file() and ROUTER_BUILTIN.stat().st_size < 2_000_000
    art = load_artifact(ROUTER_BUILTIN)
    art.check(target=TARGET_DEFAULT, hidden_size=HIDDEN)
    assert len(art.arms) >= 2 and "ar" in art.arms
    record = json.loads(ROUTER_BUILTIN.with_suffix(".json").read_text())
    assert len(record["data_sha256"]) == 64 and record["date"] and record["machine"]
    assert any("router collect" in c for c in record["commands"])


def test_the_shipped_policy_decides():
    art = load_artifact(ROUTER_BUILTIN)
    states = torch.randn(32, HIDDEN, generator=torch.Generator().manual_seed(0))
    picks = [art.policy.choose(s) for s in states]
    assert all(0 <= p < len(art.arms) for p in picks)
    assert picks == [art.policy.choose(s) for s in states]  # greedy: the same state, the same arm
    probs = art.policy.probs(states)
    assert torch.allclose(probs.sum(-1), torch.ones(32), atol=1e-5)


def test_router_without_a_path_takes_the_shipped_policy():
    spec = parse_method("router")
    assert spec.params.path == str(ROUTER_BUILTIN)
    assert parse_method("router:elsewhere.pt").params.path == "elsewhere.pt"
