"""The method-string parser shared by the CLI, the bench and the server."""

from __future__ import annotations

import pytest

from adaspec.control.heuristic import HeuristicLength
from adaspec.control.static import StaticLength
from adaspec.errors import InputError
from adaspec.methods.build import build_generator
from adaspec.methods.spec import describe_methods, parse_method, split_method_list


def test_defaults_and_overrides():
    spec = parse_method("draft")
    assert spec.name == "draft" and spec["k"] == 4 and spec["ctrl"] == "static"
    spec = parse_method(" draft:k=7, ctrl=heuristic ,k_max=12 ")
    assert spec["k"] == 7 and spec["ctrl"] == "heuristic" and spec["k_max"] == 12
    assert parse_method("ngram:k=10,n_max=4")["n_max"] == 4
    assert parse_method("ar").settings() == {}


def test_needs_draft_model():
    assert parse_method("draft:k=2").needs_draft_model()
    assert not parse_method("ngram").needs_draft_model()
    assert not parse_method("ar").needs_draft_model()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty method"),
        ("medusa", "unknown method 'medusa'; known methods: ar, draft, ngram"),
        ("draft:q=3", "has no parameter 'q'"),
        ("draft:k=three", "k must be int"),
        ("draft:k", "expected key=value"),
        ("draft:k=0", "k must be >= 1"),
        ("draft:ctrl=disco9", "unknown length controller"),
        ("draft:verify=magic", "unknown verifier"),
        ("ngram:n_min=3,n_max=2", "n_min <= n_max"),
        ("ar:k=3", "has no parameter 'k'"),
    ],
)
def test_bad_method_strings_name_the_problem(text, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        parse_method(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("draft:verify=auto", "verify=auto is now verify=default"),
        ("ngram:verify=auto", "verify=auto is now verify=default"),
        ("auto:verify=auto", "verify=auto is now verify=default"),
        ("draft:tree=auto", "tree=auto is now tree=priced"),
        ("draft:tree=AUTO,verify=mcss-wor", "tree=auto is now tree=priced"),
        ("ar@auto", "unknown weights 'auto' after '@'"),
    ],
)
def test_old_names_of_renamed_values_name_the_new_one(text, message):
    """`auto` named the default verifier and the priced tree shape before issue 32 (it names
    only the method `auto` now): the old spelling is an InputError naming the new one."""
    with pytest.raises(InputError, match=message):
        parse_method(text)


def test_the_renamed_values_parse():
    from adaspec.core.token_tree import PricedBranching
    from adaspec.verify import choose

    assert parse_method("draft:verify=default")["verify"] == "default"
    assert parse_method("draft")["verify"] == "default"
    assert isinstance(parse_method("draft:tree=priced").tree, PricedBranching)
    with pytest.raises(InputError, match="verify=auto is now verify=default"):
        choose("auto", trees=False)


def test_controllers_built_from_spec(target, tokenizer, draft):
    def controller(method):
        return build_generator(method, target, tokenizer, draft).controller

    assert isinstance(controller("draft:k=5"), StaticLength)
    ctrl = controller("draft:ctrl=heuristic,k=3,k_max=9")
    assert isinstance(ctrl, HeuristicLength) and ctrl.max_tokens() == 3 and ctrl.k_max == 9


def test_describe_lists_every_method_and_parameter():
    text = describe_methods()
    for word in ("ar:", "draft:", "ngram:", "k=", "ctrl=", "n_max="):
        assert word in text


def test_method_lists_keep_parameters_with_their_method():
    text = "ar, ngram,draft:k=4,verify=speculative,draft:tree=4x2x1,verify=mcss,hf-assisted"
    assert split_method_list(text) == [
        "ar",
        "ngram",
        "draft:k=4,verify=speculative",
        "draft:tree=4x2x1,verify=mcss",
        "hf-assisted",
    ]
