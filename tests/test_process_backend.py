"""A backend in a child process: the same logits as in-process, the same cache moves and
input errors, a clear error when the backend cannot load, and as the draft of a torch
target the output is the target's own greedy output."""

from __future__ import annotations

import pytest
import torch

from adaspec.backends.child_process import ChildProcessFailed
from adaspec.backends.llamacpp.backend import LlamaCppBackend
from adaspec.backends.process_backend import ProcessBackend
from adaspec.errors import InputError
from adaspec.methods.build import build_generator

from .conftest import smollm_gguf, smollm_torch

# Every test runs llama.cpp (in a child, and in-process to compare); without llama-cpp-python
# even the failure to load would be that package's absence, not the one under test.
pytestmark = pytest.mark.needs("llama_cpp")

IDS = torch.tensor([1604, 3987, 46477, 24, 94, 727])


@pytest.fixture(scope="module")
def pair():
    gguf = smollm_gguf()
    local = LlamaCppBackend(gguf, n_threads=1, name="smollm", n_ctx=512)
    child = ProcessBackend(LlamaCppBackend, gguf, 1, "smollm", 512)
    yield gguf, local, child
    child.close()


def test_the_child_reports_the_backend_it_serves(pair):
    _, local, child = pair
    for attribute in ("name", "vocab_size", "max_context", "num_layers", "hidden_size",
                      "bytes_per_forward"):
        assert getattr(child, attribute) == getattr(local, attribute)
    assert not child.supports_trees and not child.has_hidden_states


def test_logits_and_cache_moves_match_the_backend_in_process(pair):
    _, local, child = pair
    for backend in (local, child):
        backend.reset()
    assert torch.equal(child.prefill(IDS[:2]).logits, local.prefill(IDS[:2]).logits)
    # more rows than the shared buffer held so far: it grows, and the rows still match
    assert torch.equal(child.forward(IDS[2:]).logits, local.forward(IDS[2:]).logits)
    assert child.cache_len == local.cache_len == 6
    child.truncate(3)
    local.truncate(3)
    assert child.cache_len == 3
    assert torch.equal(child.forward(IDS[3:4]).logits, local.forward(IDS[3:4]).logits)
    child.keep(torch.arange(2))
    assert child.cache_len == 2
    child.reset()
    assert child.cache_len == 0


def test_input_errors_cross_the_pipe_as_input_errors(pair):
    _, _, child = pair
    child.reset()
    child.forward(IDS[:2])
    with pytest.raises(InputError, match="chains only"):
        child.forward(IDS[:2], tree_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(InputError, match="prefixes only"):
        child.keep(torch.tensor([0, 1, 3]))  # raised by the backend inside the child
    with pytest.raises(InputError, match="right after its cache"):
        child.forward(IDS[:1], positions=torch.tensor([7]))
    with pytest.raises(InputError, match="context too long"):
        child.forward(torch.ones(600, dtype=torch.long))
    assert child.cache_len == 2  # a refused call changes nothing
    assert child.forward(IDS[2:3]).logits.shape == (1, child.vocab_size)


def test_a_backend_that_cannot_load_is_a_one_line_error(tmp_path):
    missing = tmp_path / "missing.gguf"
    with pytest.raises(ChildProcessFailed, match="failed while loading.*missing.gguf"):
        ProcessBackend(LlamaCppBackend, missing, 1)


def test_a_draft_in_a_child_keeps_the_torch_target_output(pair):
    gguf, _, child = pair
    from adaspec.backends.torch.backend import TorchBackend

    target = TorchBackend(smollm_torch(gguf), name="smollm-torch")
    prompt = [1604, 3987, 46477, 24, 94, 727]
    ar = build_generator("ar", target, None, None, [2]).generate(prompt, 24)
    spec = build_generator("draft:k=4", target, None, child, [2]).generate(prompt, 24)
    assert spec.token_ids == ar.token_ids
    assert spec.stats.drafted > 0 and spec.stats.accepted / spec.stats.drafted > 0.5


def test_the_gguf_weights_variant_loads_in_a_child(pair):
    from adaspec.backends.load import load_backend

    gguf = pair[0]
    backend, _, _ = load_backend(str(gguf), weights="gguf", role="draft")
    try:
        assert isinstance(backend, ProcessBackend)
        assert backend.prefill(IDS).logits.shape == (1, backend.vocab_size)
    finally:
        backend.close()
