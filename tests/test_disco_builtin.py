"""The DISCO classifier shipped for the built-in pair (`control/builtin`): it loads, it is for
the built-in pair, it says where it came from, and it decides: a confident draft keeps
drafting, a flat one stops. `draft:ctrl=disco` without `disco=` uses it; another pair gets a
one-line error that names how to build one."""

from __future__ import annotations

import json

import pytest
import torch

from adaspec.control import CONTROLLERS
from adaspec.control.builtin import DISCO_BUILTIN, provenance
from adaspec.control.disco import DiscoLength
from adaspec.errors import InputError
from adaspec.methods.spec import parse_method
from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT


def test_the_shipped_classifier_is_for_the_built_in_pair_with_its_provenance():
    assert DISCO_BUILTIN.is_file()
    assert DISCO_BUILTIN.stat().st_size < 2_000_000  # small enough for the package
    controller = DiscoLength.from_file("")
    assert controller.builtin
    assert (controller.artifact.target, controller.artifact.draft) == (TARGET_DEFAULT,
                                                                       DRAFT_DEFAULT)
    controller.check_models(TARGET_DEFAULT, DRAFT_DEFAULT)
    record = provenance(DISCO_BUILTIN)
    assert len(record["data_sha256"]) == 64 and record["date"] and record["machine"]
    assert any("disco collect" in c for c in record["commands"])
    assert record == json.loads(DISCO_BUILTIN.with_suffix(".json").read_text())


def test_the_shipped_classifier_decides():
    controller = DiscoLength.from_file("")
    vocab = 151_936
    confident = torch.full((vocab,), -30.0)
    confident[42] = 30.0  # the draft is sure of one token
    flat = torch.zeros(vocab)  # the draft has no idea
    controller.begin()
    assert 1 <= controller.max_tokens() <= 32
    assert controller.keep_drafting(0, confident) is True
    p_sure = controller.last_probability
    controller.keep_drafting(1, flat)
    assert controller.last_probability < p_sure
    assert controller.keep_drafting(1, flat) is False


def test_ctrl_disco_without_an_artifact_takes_the_shipped_one():
    spec = parse_method("draft:ctrl=disco")
    controller = CONTROLLERS["disco"].build(spec.params.length_settings(), None)
    assert isinstance(controller, DiscoLength) and controller.builtin
    with pytest.raises(InputError, match="shipped with adaspec.*disco collect") as err:
        controller.check_models("some/other-target", DRAFT_DEFAULT)
    assert "\n" not in str(err.value)
