"""Weight quantization of a torch CausalLM's Linear layers, on CPU kernels that ship with torch.

Why these kernels: on this CPU (2 cores, AVX-512) torchao 0.18's supported configs either have
no fast CPU kernel (`Int8WeightOnlyConfig`, `Int8DynamicActivationInt8WeightConfig` are as slow
as bf16 or slower) or need torchao's separately built kernel library (the `opaque` intx
packing), so we call the kernels torch itself ships, the ones gpt-fast uses on CPU:

- ``int8``: weight-only int8, one scale per output row, `aten._weight_int8pack_mm`.
- ``int4``: weight-only int4, asymmetric, one scale and zero per group of 128 inputs,
  `aten._weight_int4pack_mm_for_cpu` (tinygemm layout, packed at load time).
- ``int8-dyn``: int8 weights, activations quantized per token on the fly, integer product
  with `aten._int_mm` (exact, and nearly as cheap for 16 rows as for one, so verifying a
  draft costs about one forward). The deprecated `torch.ao` `quantize_dynamic` shares one
  activation scale across all rows of a call, which makes a token's logits depend on the
  other tokens verified with it; per-token scales do not.

Activations, embeddings, norms and the KV cache stay bf16. `adaspec bench` reports each
mode's forward times and how many greedy outputs change against bf16.

Prompt prefill: the weight-only kernels are made for a few rows (int4 costs ~30 ms per row of
a 1.5B prefill on the Xeon, bf16 ~8), so `int8` and `int4` layers keep the float weight they
were made from and use it inside `prefill_arithmetic()`, which the backend enters only for a
prompt's prefill. On a CPU without native bf16 arithmetic (AVX2: no AVX-512 bf16, no AMX)
torch's bf16 GEMM is several times slower than fp32, so there every bf16 Linear multiplies in
fp32 during prefill. Every later forward (decode steps, drafts, verification) runs the normal
path, so speculative decoding still scores exactly what plain decoding scores: both start
from the same prefill.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from adaspec.errors import InputError

QUANT_MODES = ("none", "int8", "int4", "int8-dyn")
INT4_GROUP = 128
# Modes whose kernel is slow for many rows: they keep the float weight for prompt prefill.
# (int8-dyn's integer GEMM already prefills at bf16 speed.)
DENSE_PREFILL_MODES = ("int8", "int4")


def check_quant(mode: str) -> str:
    """Validate a torch quantization mode name (among what `--weights` takes; what `adaspec
    models prepare --quant` takes)."""
    if mode not in QUANT_MODES:
        raise InputError(f"unknown quantization {mode!r}; use one of {', '.join(QUANT_MODES)}")
    return mode


class QuantLinear(nn.Module):
    """A Linear whose weight is stored quantized; `state()` is what the disk cache keeps."""

    mode: str = ""
    # Set by every subclass (annotations only, for the type checker): the activation dtype
    # and the static `quantize(weight) -> state` that builds a `state()` from a float weight.
    dtype: torch.dtype
    quantize: ClassVar[Callable[..., dict[str, torch.Tensor]]]

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # The float weight for prompt prefill (a plain attribute: not in state_dict, not
        # counted as bytes a decode step reads); used only while `use_dense` is set.
        self.dense: torch.Tensor | None = None
        self.use_dense = False

    def state(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_dense and self.dense is not None:
            return prefill_linear(x, self.dense, self.bias)
        return self.quantized_forward(x)

    def quantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def select_rows(self, rows: torch.Tensor) -> QuantLinear:
        """The same layer keeping only output rows `rows` (a restricted draft head)."""
        state = {k: v.index_select(0, rows) for k, v in self.state().items()}
        bias = self.float_bias()
        bias = None if bias is None else bias.index_select(0, rows)
        dense = None if self.dense is None else self.dense.index_select(0, rows)
        return _build(self.mode, state, bias, self.dtype, dense)

    def float_bias(self) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.detach()

    def _finish(self, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, mode={self.mode}"


class Int8WeightLinear(QuantLinear):
    mode = "int8"
    qweight: torch.Tensor  # buffers, registered in __init__
    scales: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.to(dtype))
        self.dtype = dtype

    @staticmethod
    def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-10)
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return {"qweight": q, "scales": scales}

    def state(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scales": self.scales.float()}

    def quantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.scales.dtype)
        return self._finish(torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales),
                            x.shape)


class Int4WeightLinear(QuantLinear):
    mode = "int4"
    packed: torch.Tensor  # buffers, registered in __init__
    scales_and_zeros: torch.Tensor

    def __init__(self, packed_nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        out_features, half = packed_nibbles.shape
        super().__init__(half * 2, out_features, bias)
        self.nibbles = packed_nibbles  # kept for state(); the kernel reads `packed`
        pad = -out_features % 16  # the CPU kernel packs rows in blocks of 16: pad, slice later
        if pad:
            packed_nibbles = torch.cat([packed_nibbles, packed_nibbles[-1:].expand(pad, -1)])
            scales = torch.cat([scales, scales[-1:].expand(pad, -1)])
            zeros = torch.cat([zeros, zeros[-1:].expand(pad, -1)])
        q = torch.stack([packed_nibbles >> 4, packed_nibbles & 0xF], dim=-1).reshape(
            out_features + pad, half * 2
        )
        self.register_buffer(
            "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 8)
        )
        # tinygemm reads w = (q - 8) * scale + zero, scales_and_zeros as [groups, out, 2]
        sz = torch.stack([scales.float(), zeros.float()], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", sz.to(dtype))
        self.dtype = dtype

    @staticmethod
    def quantize(weight: torch.Tensor, group: int = INT4_GROUP) -> dict[str, torch.Tensor]:
        w = weight.detach().float()
        out_features, in_features = w.shape
        if in_features % group:
            raise InputError(f"int4 needs in_features divisible by {group}, got {in_features}")
        wg = w.reshape(out_features, in_features // group, group)
        lo = wg.amin(dim=-1, keepdim=True)
        hi = wg.amax(dim=-1, keepdim=True)
        scales = ((hi - lo) / 15).clamp(min=1e-10)
        q = torch.round((wg - lo) / scales).clamp(0, 15).to(torch.uint8).reshape(out_features, -1)
        nibbles = (q[:, 0::2] << 4) | q[:, 1::2]
        zeros = lo + 8 * scales
        return {"nibbles": nibbles, "scales": scales.squeeze(-1), "zeros": zeros.squeeze(-1)}

    def state(self) -> dict[str, torch.Tensor]:
        sz = self.scales_and_zeros.float().transpose(0, 1)[: self.out_features]
        return {"nibbles": self.nibbles, "scales": sz[..., 0].contiguous(),
                "zeros": sz[..., 1].contiguous()}

    def quantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, INT4_GROUP, self.scales_and_zeros
        )
        return self._finish(y[:, : self.out_features], x.shape)


class Int8DynamicLinear(QuantLinear):
    """int8 weights x int8 activations, each token's activations scaled on its own.

    The integer product is exact and every row has its own scale, so a token's output is
    bit-identical whether it is scored alone or with a whole draft: verification is
    row-independent, and `aten._int_mm` costs about the same for 1 to 16 rows.
    """

    mode = "int8-dyn"
    qweight: torch.Tensor  # buffers, registered in __init__
    scales: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.float())
        self.dtype = dtype

    quantize = staticmethod(Int8WeightLinear.quantize)

    def state(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scales": self.scales}

    def quantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        row_scale = (flat.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-10)
        xq = torch.round(flat / row_scale).to(torch.int8)
        acc = torch._int_mm(xq, self.qweight.t())
        y = acc.float() * row_scale * self.scales
        return self._finish(y.to(self.dtype), x.shape)


_MODULES: dict[str, type[QuantLinear]] = {
    "int8": Int8WeightLinear,
    "int4": Int4WeightLinear,
    "int8-dyn": Int8DynamicLinear,
}


def _build(mode: str, state: dict[str, torch.Tensor], bias: torch.Tensor | None,
           dtype: torch.dtype, dense: torch.Tensor | None = None) -> QuantLinear:
    if mode == "int4":
        module: QuantLinear = Int4WeightLinear(
            state["nibbles"], state["scales"], state["zeros"], bias, dtype
        )
    else:
        int8 = cast("type[Int8WeightLinear] | type[Int8DynamicLinear]", _MODULES[mode])
        module = int8(state["qweight"], state["scales"], bias, dtype)
    if mode in DENSE_PREFILL_MODES and dense is not None:
        module.dense = dense.detach().to(dtype)
    return module


@cache
def native_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic (AVX-512 bf16 or AMX). Without it, torch's bf16
    GEMM converts on the fly: 402 ms for 157 x 1536 x 8960 on an AVX2 EPYC, 146 ms in fp32."""
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


# Below this many rows converting the weight to fp32 costs more than the bf16 GEMM loses
# (AVX2 EPYC, 1536 x 8960: bf16 32 ms vs fp32 53 ms at 8 rows, 224 vs 85 ms at 64).
FP32_PREFILL_ROWS = 32


def prefill_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """A Linear over a prompt's many rows: in fp32 when the weight is bf16, the CPU has no
    native bf16 and there are enough rows (the result is rounded back to x's dtype)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if weight.dtype != torch.bfloat16 or native_bf16() or rows < FP32_PREFILL_ROWS:
        return F.linear(x, weight, bias)
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


def _plain_prefill_forward(layer: nn.Linear):
    return lambda x: prefill_linear(x, layer.weight, layer.bias)


@contextmanager
def prefill_arithmetic(model: nn.Module) -> Iterator[None]:
    """Within this block every Linear runs `prefill_linear`, weight-only quantized layers
    with their float weight: for a prompt's prefill only (see the module docstring for why
    exactness is unaffected)."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m.dense is not None]
    plain = [] if native_bf16() else [m for m in model.modules() if type(m) is nn.Linear]
    for layer in layers:
        layer.use_dense = True
    for lin in plain:  # an instance attribute shadows nn.Linear.forward until removed
        lin.forward = _plain_prefill_forward(lin)  # type: ignore[method-assign]  # why: shadows
    try:
        yield
    finally:
        for layer in layers:
            layer.use_dense = False
        for lin in plain:
            del lin.forward


def linear_paths(model: nn.Module) -> list[str]:
    """Dotted names of every nn.Linear in the model (the layers quantization replaces)."""
    return [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, child, module)


def quantize_model(model: nn.Module, mode: str) -> dict[str, torch.Tensor]:
    """Replace every Linear with its quantized version, in place; returns the flat state the
    disk cache stores (`<layer>.<tensor>`), so a later load skips the rounding."""
    check_quant(mode)
    flat: dict[str, torch.Tensor] = {}
    if mode == "none":
        return flat
    dtype = _activation_dtype(model)
    for path in linear_paths(model):
        lin = cast(nn.Linear, model.get_submodule(path))  # linear_paths lists nn.Linear only
        state = _MODULES[mode].quantize(lin.weight)
        module = _build(mode, state, lin.bias, dtype, lin.weight)
        _set_module(model, path, module)
        flat.update({f"{path}.{k}": v for k, v in module.state().items()})
    return flat


def load_quantized_state(model: nn.Module, mode: str, flat: dict[str, torch.Tensor]) -> None:
    """Swap every Linear for the quantized layer stored in `flat` (from `quantize_model`)."""
    check_quant(mode)
    dtype = _activation_dtype(model)
    for path in linear_paths(model):
        prefix = f"{path}."
        state = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
        if not state:
            raise KeyError(path)
        lin = cast(nn.Linear, model.get_submodule(path))  # linear_paths lists nn.Linear only
        module = _build(mode, state, lin.bias, dtype, lin.weight)
        if (module.in_features, module.out_features) != (lin.in_features, lin.out_features):
            raise ValueError(f"{path}: stored shape does not match the model")
        _set_module(model, path, module)


def _activation_dtype(model: nn.Module) -> torch.dtype:
    hf = cast(Any, model)  # a Hugging Face model has get_input_embeddings(); others may not
    emb = hf.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None:
        return emb.weight.dtype
    return next(model.parameters()).dtype


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of weights and buffers a forward reads, quantized layers at their stored size."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            total += sum(t.numel() * t.element_size() for t in mod.state().values())
            if mod.bias is not None:
                total += mod.bias.numel() * mod.bias.element_size()
    return total


def requantized(layer: QuantLinear, weight: torch.Tensor) -> QuantLinear:
    """A quantized layer of the same mode and dtype holding a new float `weight` (a draft's
    layer after online distillation)."""
    state = _MODULES[layer.mode].quantize(weight)
    return _build(layer.mode, state, layer.float_bias(), layer.dtype,
                  weight if layer.dense is not None else None)


def set_linear_weight(model: nn.Module, path: str, weight: torch.Tensor) -> None:
    """Give the Linear (plain or quantized) at `path` a new float weight, in place."""
    layer = model.get_submodule(path)
    if isinstance(layer, QuantLinear):
        _set_module(model, path, requantized(layer, weight))
    else:
        lin = cast(nn.Linear, layer)
        lin.weight.data.copy_(weight.to(lin.weight.dtype))
