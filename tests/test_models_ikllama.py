"""The ik_llama.cpp backend: the same contract as the llama.cpp backend (the tests of
test_models_llamacpp run here again on an ik_llama.cpp backend over the SmolLM2-135M GGUF),
in a child process too, and clear errors when the package is missing or of another version."""

from __future__ import annotations

import pytest
import torch

import adaspec.backends.ikllama as ikllama
from adaspec.backends.ikllama import IkLlamaBackend, IkLlamaUnavailable

from .conftest import smollm_gguf
from .test_models_llamacpp import (  # noqa: F401  (collected again with this module's fixture)
    test_an_engine_reuses_the_prefix_of_its_previous_prompt,
    test_forward_truncate_and_chains_only,
    test_llamacpp_target_with_ngram_drafts_repeats_its_own_plain_decoding,
    test_prefill_keeps_a_shared_prefix_its_cache_holds,
)

pytestmark = pytest.mark.skipif(not ikllama.available(),
                                reason=f"ik-llama-cpp-python {ikllama.IK_VERSION} not installed")


@pytest.fixture(scope="module")
def smollm():
    gguf = smollm_gguf()
    return gguf, IkLlamaBackend(gguf, n_threads=1, name="smollm", n_ctx=512)


def test_another_version_is_refused_with_the_fix(monkeypatch):
    ikllama.library.cache_clear()
    monkeypatch.setattr(ikllama, "IK_VERSION", "9.9.9")
    try:
        with pytest.raises(IkLlamaUnavailable, match=r"9\.9\.9 is needed.*pip install"):
            ikllama.library()
    finally:
        monkeypatch.undo()
        ikllama.library.cache_clear()
    assert ikllama.available()


def test_in_a_child_process_it_scores_what_it_scores_in_process(smollm):
    from adaspec.backends.process_backend import ProcessBackend

    gguf, local = smollm
    child = ProcessBackend(IkLlamaBackend, str(gguf), 1, "smollm", 512)
    try:
        assert child.kind == "ik_llama+child" and child.tie_tolerance == local.tie_tolerance
        ids = torch.tensor([1604, 3987, 46477, 24, 94])
        a = child.prefill(ids).logits
        b = local.prefill(ids).logits
        torch.testing.assert_close(a, b)
        assert child.forward(ids[:2]).logits.shape == (2, local.vocab_size)
        child.truncate(5)
        assert child.cache_len == 5
    finally:
        child.close()
