"""Router arms: method lists, JSON configs, the paper's parameter input."""

from __future__ import annotations

import json

import pytest

from adaspec.errors import InputError
from adaspec.methods.arms import DEFAULT_ARMS, arm_parameters, parse_arms
from adaspec.methods.spec import parse_method


def test_default_and_listed_arms():
    assert list(parse_arms(None)) == list(DEFAULT_ARMS)
    arms = parse_arms("ar,draft:ctrl=heuristic,k=4,draft:k=2")
    assert arms == {m: m for m in ["ar", "draft:ctrl=heuristic,k=4", "draft:k=2"]}


def test_config_file_names_arms(tmp_path):
    cfg = tmp_path / "arms.json"
    cfg.write_text(json.dumps({"arms": {"plain": "ar", "short": "draft:k=2", "lookup": "ngram"}}))
    assert parse_arms(str(cfg)) == {"plain": "ar", "short": "draft:k=2", "lookup": "ngram"}
    cfg.write_text(json.dumps({"arms": ["ar", "ngram"]}))
    assert parse_arms(str(cfg)) == {"ar": "ar", "ngram": "ngram"}


@pytest.mark.parametrize(
    "text, message",
    [
        ("ar", "at least two arms"),
        ("ar,ar", "repeat"),
        ("ar,nonsense", "unknown method"),
        ("ar,router:x.pt", "cannot be an arm"),
        ("missing.json", "not found"),
    ],
)
def test_bad_arms_are_clear_errors(text, message):
    with pytest.raises(InputError, match=message):
        parse_arms(text)


def test_bad_config_file(tmp_path):
    cfg = tmp_path / "arms.json"
    cfg.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        parse_arms(str(cfg))
    cfg.write_text(json.dumps({"arms": 3}))
    with pytest.raises(InputError, match="expected"):
        parse_arms(str(cfg))


def test_arm_parameters():
    assert arm_parameters(parse_method("ar"), 1500, 500) == 1500
    assert arm_parameters(parse_method("ngram"), 1500, 500) == 0
    assert arm_parameters(parse_method("draft:k=2"), 1500, 500) == 500
    with pytest.raises(InputError, match="draft model"):
        arm_parameters(parse_method("draft:k=2"), 1500, None)
    # the draft head: its own layer and the output rows it keeps (the shipped one here)
    from adaspec.draft.head_artifact import builtin_for, load

    target = "qwen2.5-coder-1.5b-instruct"
    shipped = load(builtin_for(target))
    n = arm_parameters(parse_method("head:k=1"), 1_500_000_000, None, target)
    own = sum(t.numel() for t in shipped.state.values())
    assert n == own + len(shipped.token_ids) * shipped.config.hidden
    assert 10_000_000 < n < 50_000_000
    # auto: the most of its sources (n-grams and the history nothing)
    assert arm_parameters(parse_method("auto:use=ngram+history"), 1500, None, target) == 0
    assert arm_parameters(parse_method("auto:use=ngram+head"), 1500, None, target) == n
    assert arm_parameters(parse_method("auto:use=ngram+draft"), 1500, 500, target) == 500
