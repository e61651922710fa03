"""Quantized Linear layers: close to the float layer, same shapes, exact speculative decoding
against the quantized target itself."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from adaspec.backends.torch.backend import TorchBackend
from adaspec.core.sampling import SamplingParams
from adaspec.errors import InputError
from adaspec.methods.build import build_generator
from adaspec.store.quant import (
    DENSE_PREFILL_MODES,
    FP32_PREFILL_ROWS,
    QUANT_MODES,
    Int4WeightLinear,
    Int8WeightLinear,
    check_quant,
    linear_paths,
    load_quantized_state,
    prefill_arithmetic,
    quantize_model,
    quantized_bytes,
)
from tests.conftest import CharTokenizer, tiny_model

MODES = [m for m in QUANT_MODES if m != "none"]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_approximate_the_float_layer(dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 96, bias=True).to(dtype)
    x = torch.randn(5, 256, dtype=dtype)
    with torch.no_grad():
        ref = lin(x)
    errs = {}
    for mode, cls in (("int8", Int8WeightLinear), ("int4", Int4WeightLinear)):
        model = torch.nn.Sequential(copy.deepcopy(lin))
        quantize_model(model, mode)
        assert isinstance(model[0], cls)
        y = model(x)
        assert y.shape == ref.shape and y.dtype == dtype
        errs[mode] = _rel_err(y, ref)
    # int8 keeps ~7 bits per weight, int4 ~3: the error ratio shows the modes really differ
    assert errs["int8"] < 0.02
    assert errs["int4"] < 0.12
    assert errs["int4"] > 3 * errs["int8"]


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(InputError, match="unknown quantization 'int3'"):
        check_quant("int3")


def test_every_linear_is_replaced_and_bytes_shrink():
    model = tiny_model(vocab=64, hidden=128)
    dense = sum(model.get_submodule(p).weight.numel() for p in linear_paths(model))
    quantize_model(model, "int4")
    assert linear_paths(model) == []
    assert all(not isinstance(m, torch.nn.Linear) for m in model.modules())
    stored = quantized_bytes(model)
    assert 0 < stored < dense  # < 1 byte per weight (4 bits + group scales)


@pytest.mark.parametrize("mode", MODES)
def test_stored_state_round_trips(mode):
    model = tiny_model(vocab=64, hidden=128)
    fresh = copy.deepcopy(model)
    flat = quantize_model(model, mode)
    load_quantized_state(fresh, mode, flat)
    ids = torch.randint(0, 64, (1, 12))
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, fresh(input_ids=ids).logits)


def test_loading_a_state_of_the_wrong_shape_fails():
    flat = quantize_model(tiny_model(vocab=64, hidden=128), "int8")
    with pytest.raises((ValueError, KeyError, RuntimeError)):
        load_quantized_state(tiny_model(vocab=64, hidden=256), "int8", flat)


@pytest.mark.parametrize("mode", MODES)
def test_greedy_speculation_equals_plain_decoding_of_the_quantized_target(mode):
    """Exactness holds against the configured target: both runs use the same int target."""
    target = tiny_model(vocab=64, hidden=128, layers=2, seed=1)
    draft = copy.deepcopy(target)  # an int4 copy of the target: agrees often, not always
    quantize_model(target, mode)
    quantize_model(draft, "int4")
    tok = CharTokenizer(64)
    prompt = [5, 9, 11, 3, 7]
    plain = build_generator("ar", TorchBackend(target), tok).generate(prompt, 40, SamplingParams())
    spec = build_generator("draft:k=4", TorchBackend(target), tok, TorchBackend(draft)).generate(
        prompt, 40, SamplingParams()
    )
    assert spec.token_ids == plain.token_ids
    assert spec.stats.target_calls < plain.stats.target_calls


def test_quantization_changes_the_model():
    """The quantized target is a different function from the float one (so the test above is
    about the quantized target, not the float one it came from)."""
    model = tiny_model(vocab=64, hidden=128, seed=1)
    ids = torch.randint(0, 64, (1, 16))
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        quantize_model(model, "int4")
        after = model(input_ids=ids).logits
    assert not torch.equal(before, after)


@pytest.mark.parametrize("mode", MODES)
def test_restricted_head_slices_a_quantized_head(mode):
    """vocab=N on a quantized draft keeps the quantized rows: logits on the kept ids equal
    the full quantized head's, everything else is -inf."""
    from adaspec.backends.torch.restricted_head import RestrictedHeadLM

    model = tiny_model(vocab=64, hidden=128, seed=4)
    quantize_model(model, mode)
    keep = [0, 3, 5, 17, 40, 63]
    small = RestrictedHeadLM(model, keep)
    assert isinstance(small.head, type(model.get_output_embeddings()))
    assert small.head.out_features == len(keep)
    ids = torch.randint(0, 64, (1, 7))
    with torch.inference_mode():
        full = model(input_ids=ids).logits
        part = small(input_ids=ids).logits
    torch.testing.assert_close(part[..., keep], full[..., keep])
    outside = [i for i in range(64) if i not in keep]
    assert torch.isinf(part[..., outside]).all()


def test_int8_dyn_rows_do_not_depend_on_each_other():
    """A token's output is bit-identical alone or in a batch (per-token scales, integer
    product): verification scores exactly what plain decoding would."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 48))
    quantize_model(model, "int8-dyn")
    x = torch.randn(9, 128)
    x[4] *= 50  # one loud row must not change the others' scale
    with torch.no_grad():
        batched = model(x)
        alone = torch.cat([model(x[i : i + 1]) for i in range(9)])
    assert torch.equal(batched, alone)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_weight_only_layers_use_the_float_weight_only_inside_prefill_arithmetic(mode):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 48)
    model = torch.nn.Sequential(copy.deepcopy(lin))
    quantize_model(model, mode)
    x = torch.randn(20, 256)
    with torch.no_grad():
        quantized = model(x)
        with prefill_arithmetic(model):
            dense = model(x)
        after = model(x)
        ref = lin(x)
    torch.testing.assert_close(dense, ref)
    assert torch.equal(after, quantized)
    assert not torch.allclose(quantized, ref, atol=1e-4)  # the kernel really is another function


@pytest.fixture
def no_native_bf16(monkeypatch):
    """Pretend this CPU has no bf16 arithmetic (an AVX2 machine)."""
    monkeypatch.setattr("adaspec.store.quant.native_bf16", lambda: False)


@pytest.mark.parametrize("rows", [FP32_PREFILL_ROWS - 1, FP32_PREFILL_ROWS, 90])
def test_bf16_prefill_multiplies_in_fp32_on_a_cpu_without_bf16(no_native_bf16, rows):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 64).to(torch.bfloat16))
    x = torch.randn(rows, 512).to(torch.bfloat16)
    lin = model[0]
    with torch.no_grad():
        bf16 = lin(x)
        fp32 = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
        with prefill_arithmetic(model), _weight_dtypes() as seen:
            got = model(x)
        after = model(x)
    fp32_route = rows >= FP32_PREFILL_ROWS
    assert seen == [torch.float32 if fp32_route else torch.bfloat16]
    assert torch.equal(got, fp32.to(torch.bfloat16) if fp32_route else bf16)
    assert torch.equal(after, bf16) and "forward" not in vars(lin)  # restored


@contextlib.contextmanager
def _weight_dtypes():
    """Records the weight dtype of every F.linear call the quant module makes."""
    import adaspec.store.quant as quant

    seen: list[torch.dtype] = []
    real = quant.F.linear

    def spy(x, weight, bias=None):
        seen.append(weight.dtype)
        return real(x, weight, bias)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant.F, "linear", spy)
        yield seen


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_float_weight_prefill_runs_in_fp32_without_bf16(no_native_bf16, mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 48).to(torch.bfloat16))
    dense = model[0].weight.detach().clone()
    quantize_model(model, mode)
    x = torch.randn(FP32_PREFILL_ROWS, 256).to(torch.bfloat16)
    with torch.no_grad(), prefill_arithmetic(model), _weight_dtypes() as seen:
        got = model(x)
    want = torch.nn.functional.linear(x.float(), dense.float(), model[0].bias.float())
    assert seen == [torch.float32]
    assert torch.equal(got, want.to(torch.bfloat16))


def test_prefill_arithmetic_restores_the_quantized_path_after_an_error():
    model = torch.nn.Sequential(torch.nn.Linear(128, 16))
    quantize_model(model, "int4")
    with pytest.raises(RuntimeError), prefill_arithmetic(model):
        assert model[0].use_dense
        raise RuntimeError("boom")
    assert not model[0].use_dense


@pytest.mark.parametrize("mode", MODES)
def test_backend_prefill_scores_the_prompt_with_float_weights_for_weight_only_modes(mode):
    """int8 / int4 prefill = the float model's prefill (slow kernels avoided for many rows);
    int8-dyn keeps its own kernel there, and decode steps always run quantized."""
    ref = tiny_model(vocab=64, hidden=128, layers=2, seed=3)
    model = copy.deepcopy(ref)
    quantize_model(model, mode)
    ids = torch.randint(0, 64, (12,))
    backend = TorchBackend(model)
    got = backend.prefill(ids).logits
    with torch.inference_mode():
        want = ref(input_ids=ids.view(1, -1)).logits[0, -1:]  # prefill scores the last row
    if mode in DENSE_PREFILL_MODES:
        torch.testing.assert_close(got, want)
    else:
        assert not torch.allclose(got, want, atol=1e-4)
    assert not any(getattr(m, "use_dense", False) for m in model.modules())
