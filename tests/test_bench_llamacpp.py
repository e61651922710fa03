"""The llama.cpp bench methods (`llamacpp`, and llama-cpp-python's own speculative modes
`llamacpp-lookup` and `llamacpp-draft`): parsing, the one-line skip without the extra, their
rows counted as a quality difference (other weights) rather than exactness bugs, and, when
llama-cpp-python and the SmolLM2 GGUF package are installed, greedy decoding of a real tiny
GGUF (the speculative modes reproduce plain llama.cpp greedy decoding)."""

from __future__ import annotations

import sys

import pytest

from adaspec.backends.gguf import gguf_file
from adaspec.core.metrics import RequestStats
from adaspec.errors import InputError, ModelStoreError
from adaspec.lab.bench import runner as runner_module
from adaspec.lab.bench.llamacpp_reference import (
    GgufDraft,
    LlamaCppUnavailable,
    SpeculativeDecoder,
    open_decoder,
)
from adaspec.lab.bench.references import REFERENCE_METHODS, other_weights, parse_bench_method
from adaspec.lab.bench.report import to_markdown
from adaspec.lab.bench.runner import read_rows
from adaspec.methods.spec import describe_methods, parse_method

from .conftest import smollm_gguf
from .test_bench_runner import PROMPTS, make_runner


def test_llamacpp_parses_only_for_the_bench():
    spec = parse_bench_method("llamacpp")
    assert spec.is_reference and other_weights(spec) and not spec.needs_draft_model()
    assert not other_weights(parse_bench_method("hf-assisted"))
    with pytest.raises(InputError, match="unknown method 'llamacpp'"):
        parse_method("llamacpp")  # the runtime's parser knows adaspec methods only
    with pytest.raises(InputError, match="has no parameter 'k'"):
        parse_bench_method("llamacpp:k=2")
    assert "llamacpp:" in describe_methods(REFERENCE_METHODS)


def test_llamacpp_speculative_methods_parse_only_for_the_bench():
    lookup = parse_bench_method("llamacpp-lookup")
    assert lookup.settings() == {"k": 4, "n_max": 2}
    assert lookup.is_reference and other_weights(lookup) and not lookup.needs_draft_model()
    assert parse_bench_method("llamacpp-lookup:k=8,n_max=3").settings() == {
        "k": 8,
        "n_max": 3,
    }
    draft = parse_bench_method("llamacpp-draft:k=2")
    assert draft.settings() == {"k": 2}
    # it runs the draft's GGUF in llama.cpp: the torch draft is not needed
    assert other_weights(draft) and not draft.needs_draft_model()
    assert parse_bench_method("llamacpp-draft").settings() == {"k": 4}
    for text in ("llamacpp-lookup:k=0", "llamacpp-draft:k=0", "llamacpp-draft:k=-2"):
        with pytest.raises(InputError, match="k must be >= 1"):
            parse_bench_method(text)
    with pytest.raises(InputError, match="has no parameter 'n_max'"):
        parse_bench_method("llamacpp-draft:n_max=2")
    with pytest.raises(InputError, match="has no parameter 'ctrl'"):
        parse_bench_method("llamacpp-lookup:ctrl=heuristic")
    with pytest.raises(InputError, match="k must be int"):
        parse_bench_method("llamacpp-lookup:k=two")
    for name in ("llamacpp-lookup", "llamacpp-draft"):
        with pytest.raises(InputError, match="unknown method"):
            parse_method(name)
        assert f"{name}:" in describe_methods(REFERENCE_METHODS)
    with pytest.raises(InputError, match="n_max must be >= 1"):
        open_decoder("x.gguf", 0.0, method="llamacpp-lookup", params={"k": 4, "n_max": 0})


def test_skipped_with_one_line_without_the_extra(tmp_path, target, draft, tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now fails
    with pytest.raises(LlamaCppUnavailable, match=r"pip install 'adaspec\[llamacpp\]'"):
        open_decoder(tmp_path / "model.gguf", 0.0)
    runner = make_runner(
        tmp_path, target, draft, tokenizer, ["llamacpp", "draft:k=2"], max_new_tokens=6
    )
    assert runner.methods == ["ar", "draft:k=2"]
    assert "llamacpp" in runner.skipped and "adaspec[llamacpp]" in runner.skipped["llamacpp"]
    summary = runner.run(PROMPTS[:1])
    assert set(summary["methods"]) == {"ar", "draft:k=2"}


def test_speculative_modes_skipped_without_the_extra(
    tmp_path, target, draft, tokenizer, monkeypatch
):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    for method in ("llamacpp-lookup", "llamacpp-draft"):
        with pytest.raises(LlamaCppUnavailable, match=r"pip install 'adaspec\[llamacpp\]'"):
            open_decoder(tmp_path / "model.gguf", 0.0, method=method, params={"k": 2})
    runner = make_runner(
        tmp_path, target, draft, tokenizer, ["llamacpp-lookup:k=3", "llamacpp-draft"]
    )
    assert runner.methods == ["ar"]
    assert set(runner.skipped) == {"llamacpp-lookup:k=3", "llamacpp-draft"}


def test_skip_note_is_one_line(tmp_path, target, draft, tokenizer, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    make_runner(tmp_path, target, draft, tokenizer, ["llamacpp"])
    err = capsys.readouterr().err.strip()
    assert err.startswith("llamacpp: skipped: llama-cpp-python is not installed")
    assert "\n" not in err and "Traceback" not in err


@pytest.mark.needs("llama_cpp")
def test_no_gguf_and_sampling_are_skip_reasons(tmp_path):
    with pytest.raises(LlamaCppUnavailable, match="not a GGUF file"):
        open_decoder(None, 0.0)
    with pytest.raises(LlamaCppUnavailable, match="greedily only"):
        open_decoder(tmp_path / "x.gguf", 0.7)
    for method in ("llamacpp-lookup", "llamacpp-draft"):
        with pytest.raises(LlamaCppUnavailable, match="greedily only"):
            open_decoder(tmp_path / "x.gguf", 0.7, method=method, params={"k": 4})
        with pytest.raises(LlamaCppUnavailable, match="not a GGUF file"):
            open_decoder(None, 0.0, method=method, params={"k": 4})
    # llamacpp-draft runs the draft's GGUF: a draft without one is a skip reason
    for no_gguf in (None, str(tmp_path)):
        with pytest.raises(LlamaCppUnavailable, match="draft is not one"):
            open_decoder(tmp_path / "x.gguf", 0.0, method="llamacpp-draft", draft=no_gguf)


def test_target_gguf_of_a_directory_is_none_and_a_bad_file_is_an_error(tmp_path):
    assert gguf_file(str(tmp_path)) is None
    assert gguf_file(str(tmp_path / "missing")) is None
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    with pytest.raises(ModelStoreError, match="not a GGUF file"):
        gguf_file(str(bad))


class FakeDecoder:
    """Plays llama.cpp: answers `ar`'s tokens, but changes one token of prompt t/1 (other
    weights give other greedy outputs)."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]]) -> None:
        self.reference = reference

    def generate(self, prompt_ids, max_new_tokens, eos_token_ids):
        out = list(self.reference[tuple(prompt_ids)])
        if len(out) > 2 and tuple(prompt_ids) == min(self.reference):
            out[2] = (out[2] + 1) % 60 + 1
        stats = RequestStats(len(prompt_ids), len(out), target_calls=len(out), wall_time=0.01)
        return out, stats


def test_other_weights_rows_are_a_quality_difference_not_bugs(
    tmp_path, target, draft, tokenizer, monkeypatch
):
    from adaspec.methods.build import build_generator

    engine = build_generator("ar", target, tokenizer, None, [0])
    prompts = PROMPTS[:2]
    reference = {}
    for p in prompts:
        ids = engine.encode_prompt(p.text)
        reference[tuple(ids)] = engine.generate(ids, 8).token_ids
    opened = []

    def fake_open(gguf, t, **kw):
        opened.append(kw.get("method", "llamacpp"))
        return FakeDecoder(reference)

    monkeypatch.setattr(runner_module, "open_decoder", fake_open)
    methods = ["llamacpp", "llamacpp-lookup:k=3", "llamacpp-draft"]
    runner = make_runner(tmp_path, target, draft, tokenizer, methods, max_new_tokens=8)
    # one decoder per llama.cpp method, opened for that method
    assert opened == ["llamacpp", "llamacpp-lookup", "llamacpp-draft"]
    assert set(runner.reference_decoders) == set(methods)
    summary = runner.run(prompts)
    rows = read_rows(tmp_path / "out" / "results.jsonl")[0]
    assert {r["method"] for r in rows} == {"ar", *methods}
    assert all(r.get("other_weights") for r in rows if r["method"] != "ar")
    ex = summary["exactness"]
    assert ex["bugs"] == 0 and ex["differs"] == 0 and ex["checked"] == 0
    for m in methods:
        assert ex["other_weights"][m] == {"compared": 2, "differ": 1, "first_difference": [2],
                                          "runtime": False}
        assert summary["methods"][m]["differs_from_ar"] == 1
    md = to_markdown(summary)
    assert "1 (other weights)" in md and "not a bug" in md and "BUG" not in md


# ------------------------------------------------------------------ a real tiny GGUF
@pytest.mark.needs("llama_cpp")
def test_greedy_decoding_of_a_real_gguf_matches_llama_cpp_sampler():
    gguf = smollm_gguf()
    decoder = open_decoder(gguf, 0.0, isolated=False)
    prompt = decoder.llm.tokenize(b"def fibonacci(n):", add_bos=False)
    eos = [decoder.llm.token_eos()]
    out, stats = decoder.generate(prompt, 12, eos)
    again, _ = decoder.generate(prompt, 12, eos)  # the cache is reset between requests
    assert out == again and 1 <= len(out) <= 12
    assert stats.target_calls == stats.new_tokens == len(out)
    assert 0 < stats.prefill_time <= stats.wall_time
    # llama.cpp's own greedy sampler gives the same tokens
    ref = []
    for tok in decoder.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        ref.append(int(tok))
        if tok in eos or len(ref) == len(out):
            break
    assert out == ref
    # the bench's decoder runs in a child process and answers the same
    isolated = open_decoder(gguf, 0.0)
    child_out, child_stats = isolated.generate(prompt, 12, eos)
    assert child_out == out and child_stats.new_tokens == len(out)
    isolated._child._proc.kill()  # a dead llama.cpp process is a one-line error, not a crash
    isolated._child._proc.wait()
    with pytest.raises(LlamaCppUnavailable, match="process died"):
        isolated.generate(prompt, 12, eos)


@pytest.mark.needs("llama_cpp")
def test_a_bad_file_in_the_child_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(LlamaCppUnavailable, match="could not load|failed while loading"):
        open_decoder(bad, 0.0)


# A prompt with repetition: prompt lookup finds its continuations, and no top-2 gap along the
# answer is a near tie (where llama.cpp's logits for a token in a block differ slightly from
# its one-token pass, so speculation may resolve the tie the other way).
REPEAT_PROMPT = (
    b"<|im_start|>user\nRepeat this list exactly: apple, banana, cherry, apple, banana, cherry, "
    b"apple, banana, cherry.<|im_end|>\n<|im_start|>assistant\n"
)


def _plain_greedy(gguf, n_new):
    decoder = open_decoder(gguf, 0.0, isolated=False)
    prompt = decoder.llm.tokenize(REPEAT_PROMPT, add_bos=False)
    eos = [decoder.llm.token_eos()]
    out, _ = decoder.generate(prompt, n_new, eos)
    return prompt, eos, out


def _check_speculative_stats(stats, out, prompt):
    assert stats.new_tokens == len(out) and stats.prompt_tokens == len(prompt)
    assert 0 < stats.prefill_time <= stats.wall_time and stats.verify_time > 0
    assert stats.drafted == sum(d for d, _ in stats.steps) > 0
    assert stats.accepted == sum(a for _, a in stats.steps) > 0
    assert all(0 <= a <= d for d, a in stats.steps)
    # speculation: fewer target passes than tokens; each pass gives its accepted tokens + 1
    assert stats.target_calls < stats.new_tokens <= stats.target_calls + stats.accepted


@pytest.mark.needs("llama_cpp")
def test_llama_cpp_prompt_lookup_reproduces_plain_greedy_decoding():
    gguf = smollm_gguf()
    prompt, eos, plain = _plain_greedy(gguf, 32)
    assert len(plain) == 32
    lookup = open_decoder(
        gguf, 0.0, isolated=False, method="llamacpp-lookup", params={"k": 4, "n_max": 2}
    )
    assert isinstance(lookup, SpeculativeDecoder)
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    assert isinstance(lookup.llm.draft_model.inner, LlamaPromptLookupDecoding)  # theirs
    out, stats = lookup.generate(prompt, 32, eos)
    assert out == plain
    _check_speculative_stats(stats, out, prompt)
    assert stats.draft_calls == 0 and stats.draft_prefill_time == 0  # no draft model runs
    assert all(d <= 4 for d, _ in stats.steps)
    again, stats2 = lookup.generate(prompt, 32, eos)  # the cache is reset between requests
    assert again == out and stats2.target_calls == stats.target_calls
    short, _ = lookup.generate(prompt, 5, eos)  # the token budget holds mid-block
    assert short == plain[:5]
    # in a child process, as the bench runs it: the same answer
    child = open_decoder(gguf, 0.0, method="llamacpp-lookup", params={"k": 4, "n_max": 2})
    try:
        child_out, child_stats = child.generate(prompt, 32, eos)
    finally:
        child.close()
    assert child_out == plain and child_stats.accepted > 0


@pytest.mark.needs("llama_cpp")
def test_llama_cpp_draft_model_mode_reproduces_plain_greedy_decoding():
    gguf = smollm_gguf()
    prompt, eos, plain = _plain_greedy(gguf, 24)
    # the model drafts for itself: the draft GGUF is the same file
    spec = open_decoder(
        gguf, 0.0, isolated=False, method="llamacpp-draft", params={"k": 3}, draft=str(gguf)
    )
    assert isinstance(spec.llm.draft_model.inner, GgufDraft)
    from llama_cpp.llama_speculative import LlamaDraftModel

    assert isinstance(spec.llm.draft_model.inner, LlamaDraftModel)
    out, stats = spec.generate(prompt, 24, eos)
    assert out == plain
    _check_speculative_stats(stats, out, prompt)
    assert all(d == 3 for d, _ in stats.steps)
    # k draft passes per step, the first of them evaluating the prompt
    assert stats.draft_calls == 3 * len(stats.steps)
    assert 0 < stats.draft_prefill_time < stats.draft_time
    again, _ = spec.generate(prompt, 24, eos)
    assert again == out


@pytest.mark.needs("llama_cpp")
def test_gguf_draft_keeps_its_cache_and_drops_rejected_tokens():
    gguf = smollm_gguf()
    import numpy as np

    from adaspec.backends.llamacpp.backend import repack_choice

    # repacking as the bench decides it: on, unless its probe crashed on this CPU
    drafter = GgufDraft(gguf, n_threads=1, k=3, n_ctx=256, repack=repack_choice(gguf, 1).on)
    llm = drafter.decoder.llm
    ids = llm.tokenize(b"def fibonacci(n):\n    if n < 2:", add_bos=False)
    first = drafter(np.array(ids, dtype=np.intc)).tolist()
    assert len(first) == 3 and drafter.calls == 3
    # the cache holds the context and the first k - 1 draft tokens
    assert llm.input_ids[: llm.n_tokens].tolist() == ids + first[:2]
    # a context that rejected the second draft token: the cache keeps the common prefix
    other = (first[1] + 1) % drafter.n_vocab
    context = ids + [first[0], other]
    second = drafter(np.array(context, dtype=np.intc)).tolist()
    assert llm.input_ids[: len(context)].tolist() == context
    # what a fresh draft with an empty cache gives for that context
    drafter.reset()
    assert drafter(np.array(context, dtype=np.intc)).tolist() == second
