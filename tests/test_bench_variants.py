"""Methods written NAME@WEIGHTS[/DRAFT_WEIGHTS] run on quantized copies of the models in the
same bench run; each is checked for exactness against plain decoding of its own target."""

from __future__ import annotations

import copy

import pytest

from adaspec.backends.torch.backend import TorchBackend
from adaspec.errors import InputError
from adaspec.lab.bench.runner import BenchConfig, BenchRunner, read_rows, with_variant_baselines
from adaspec.lab.bench.suites import Prompt
from adaspec.methods.build import build_generator
from adaspec.store.quant import QuantLinear, quantize_model
from tests.conftest import tiny_model

PROMPTS = [Prompt("t/0", "code", "def add(a, b):"), Prompt("t/1", "code", "for i in range(9):")]


def test_each_quantized_target_gets_its_own_baseline():
    methods = ["ar", "ngram", "draft:k=3@int8/int4", "ar@int4", "ngram@int4"]
    assert with_variant_baselines(methods) == [
        "ar", "ar@int8", "ar@int4", "ngram", "draft:k=3@int8/int4", "ngram@int4",
    ]


def _runner(tmp_path, target, draft, tokenizer, methods, loader):
    config = BenchConfig(methods=methods, suites=["test"], max_new_tokens=12,
                         out=str(tmp_path / "out"))
    return BenchRunner(config, target, tokenizer, draft, eos_token_ids=[0], progress=False,
                       load_variant=loader)


def test_variants_run_on_quantized_models_and_are_exact(
    tmp_path, target, draft, tokenizer, target_model, draft_model
):
    loads = []

    def loader(role: str, quant: str) -> TorchBackend:
        loads.append((role, quant))
        model = copy.deepcopy(target_model if role == "target" else draft_model)
        quantize_model(model, quant)
        return TorchBackend(model, name=f"tiny-{role}-{quant}")

    runner = _runner(tmp_path, target, draft, tokenizer, ["draft:k=3@int8/int8", "ngram"], loader)
    assert sorted(loads) == [("draft", "int8"), ("target", "int8")]  # each variant loaded once
    tgt, drf = runner.backends["draft:k=3@int8/int8"]
    assert any(isinstance(m, QuantLinear) for m in tgt.model.modules())
    assert any(isinstance(m, QuantLinear) for m in drf.model.modules())
    summary = runner.run(PROMPTS)
    rows, _ = read_rows(tmp_path / "out" / "results.jsonl")
    by = {(r["prompt_id"], r["method"]): r for r in rows}
    for p in PROMPTS:
        spec_row, base = by[(p.id, "draft:k=3@int8/int8")], by[(p.id, "ar@int8")]
        assert spec_row["exactness_checked"] and spec_row["divergence"] is None
        assert spec_row["token_ids"] == base["token_ids"]
        assert base["other_weights"] and "weights_difference" in base  # quality vs bf16 `ar`
    assert summary["exactness"]["bugs"] == 0
    assert set(summary["methods"]) >= {"ar", "ar@int8", "draft:k=3@int8/int8", "ngram"}


def test_a_wrong_variant_output_is_caught(tmp_path, target, draft, tokenizer):
    """The exactness check compares a variant with its own baseline: `ngram@int8` run on the
    float target (a wrong variant) reproduces `ar`, and is caught against `ar@int8`."""

    def loader(role: str, quant: str) -> TorchBackend:
        model = tiny_model(seed=3)  # an int8 target whose plain decoding parts from the float's
        quantize_model(model, quant)
        return TorchBackend(model, name=f"tiny-{role}-{quant}")

    messages: list[str] = []
    config = BenchConfig(methods=["ngram@int8"], max_new_tokens=12, out=str(tmp_path / "out"))
    runner = BenchRunner(config, target, tokenizer, draft, eos_token_ids=[0], progress=False,
                         load_variant=loader, log=messages.append)
    assert runner.baseline_of("ngram@int8") == "ar@int8"
    assert runner.baseline_of("ngram") == "ar"
    runner.engines["ngram@int8"] = build_generator("ngram", target, tokenizer, None, [0])  # wrong
    summary = runner.run(PROMPTS)
    by = {(r["prompt_id"], r["method"]): r for r in runner.rows}
    for p in PROMPTS:
        ar, base, wrong = (by[(p.id, m)] for m in ("ar", "ar@int8", "ngram@int8"))
        assert ar["token_ids"] != base["token_ids"]  # the two targets do decode differently
        assert wrong["token_ids"] == ar["token_ids"]  # so the float run is the wrong one
        assert wrong["exactness_checked"] and wrong["divergence"]["kind"] == "bug"
    ex = summary["exactness"]
    assert (ex["differs"], ex["bugs"]) == (len(PROMPTS), len(PROMPTS))
    assert {d["method"] for d in ex["divergences"]} == {"ngram@int8"}
    assert sum("ngram@int8 differs from ar@int8" in m for m in messages) == len(PROMPTS)


def test_variant_without_loader_is_a_clear_error(tmp_path, target, draft, tokenizer):
    with pytest.raises(InputError, match="cannot load a int8 target"):
        _runner(tmp_path, target, draft, tokenizer, ["ngram@int8"], None)


def test_the_runs_own_quantization_needs_no_second_baseline():
    assert with_variant_baselines(["ar", "draft:k=4@none/int4", "ngram@int8"]) == [
        "ar", "ar@int8", "draft:k=4@none/int4", "ngram@int8",
    ]


def test_gguf_is_a_weights_variant_with_its_own_baseline_and_bad_variants_are_named():
    from adaspec.methods.spec import parse_method

    spec = parse_method("draft:k=3@gguf/gguf")
    assert (spec.weights, spec.draft_weights) == ("gguf", "gguf")
    assert with_variant_baselines(["ar", "ngram@gguf"]) == ["ar", "ar@gguf", "ngram@gguf"]
    with pytest.raises(InputError, match="unknown weights 'int3' after '@'.*gguf"):
        parse_method("ngram@int3")
