"""A new drafter plugs in through the method registry alone: registered from outside the
package (as a plugin or a new module would be), it parses, builds, decodes exactly, and shows
up in `adaspec methods`, with no edit to the engine, the parser or the CLI."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from adaspec.core.proposal import Proposal
from adaspec.draft.base import Drafter
from adaspec.engine.loop import Engine
from adaspec.errors import InputError
from adaspec.methods.build import build_generator
from adaspec.methods.params import check, param
from adaspec.methods.registry import METHODS, Method
from adaspec.methods.spec import describe_methods, parse_method
from adaspec.registry import Registry

from .test_engine import PROMPTS, reference_greedy


class RepeatLast(Drafter):
    """Proposes the last token k times (right only on runs of one token)."""

    name = "repeat-last"

    def propose(self, req, max_tokens, controller):
        return Proposal.chain(req.context[-1], [req.context[-1]] * max_tokens)


@dataclass(frozen=True)
class RepeatParams:
    k: int = param(2, "tokens to propose")
    verify: str = param("default", "verifier")

    def __post_init__(self) -> None:
        check(self.k >= 1, "k must be >= 1")


def _build(params: RepeatParams, models, text: str) -> Engine:
    from adaspec.control.static import StaticLength

    return Engine(models.target, models.tokenizer, drafter=RepeatLast(),
                  controller=StaticLength(params.k), verify=params.verify,
                  eos_token_ids=models.eos_token_ids)


@pytest.fixture
def repeat_method(monkeypatch):
    METHODS.names()  # the built-ins load first
    method = Method("repeat", "propose the last token again", RepeatParams, _build)
    monkeypatch.setitem(METHODS._entries, "repeat", method)
    return method


def test_a_registered_drafter_parses_builds_and_decodes_exactly(repeat_method, target,
                                                                target_model):
    spec = parse_method("repeat:k=3")
    assert spec.method is repeat_method and spec.params == RepeatParams(k=3)
    engine = build_generator(spec, target, None, None, eos_token_ids=[])
    res = engine.generate(PROMPTS[1], max_new_tokens=12)
    assert res.token_ids == reference_greedy(target_model, PROMPTS[1], 12)
    assert res.stats.drafted > 0
    assert "repeat: propose the last token again" in describe_methods()
    with pytest.raises(InputError, match="k must be >= 1"):
        parse_method("repeat:k=0")


def test_unknown_names_list_the_known_ones():
    with pytest.raises(InputError, match="unknown method 'nope'; known methods: ar, draft"):
        parse_method("nope")
    reg: Registry[int] = Registry("widget")
    reg.register("a", 1)
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("a", 2)
    with pytest.raises(InputError, match="unknown widget 'b'; known: a"):
        reg["b"]
