"""Row-invariant attention: every query row is scored exactly as a one-token decode step.

Why: speculative decoding's greedy contract is "the same tokens as plain decoding", but plain
decoding scores one token per forward while verification scores a block. Batched attention
kernels (SDPA) pick their blocking and accumulation order from the number of query rows, so a
row's output in a block differs from the same row alone in the last bits; weight-quantized
layers then round those bits into whole quantization steps (int8-dyn showed logit differences
up to 1.06 and flipped argmaxes). With every Linear layer row-independent (the quantized
kernels in `store/quant.py` are), attention is the only place where rows meet. Here each row
attends through the same call a decode step makes: its query alone, over exactly the keys it
may see (a prefix of the cache for a chain, the gathered context + ancestors for a tree), so
verification is bit-identical to plain decoding of the same target.

Cost: one small attention call per query row and layer (a block of 8 rows on the 1.5B
target adds 8 x 28 of them), measured by `experiments/fastcpu_forward.py`. Prompt prefill is
the same for plain and speculative decoding, so it keeps the batched kernel
(`batched_attention()`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

ROW_INVARIANT = "adaspec_row_invariant"

_batched: ContextVar[bool] = ContextVar("adaspec_batched_attention", default=False)
# The visible-key plan of the last mask seen (every layer of one forward gets the same mask
# object), kept as one tuple that is replaced whole, never mutated: (mask, (n, kv_len), plan).
_plan_memo: tuple = (None, None, None)

Visible = slice | torch.Tensor


@contextmanager
def batched_attention() -> Iterator[None]:
    """Inside this block a row-invariant model uses the batched SDPA kernel (prompt prefill,
    which plain and speculative decoding share, so it needs no row invariance)."""
    token = _batched.set(True)
    try:
        yield
    finally:
        _batched.reset(token)


def visible_keys(mask: torch.Tensor | None, n: int, kv_len: int) -> list[Visible]:
    """For each of `n` query rows, the keys it attends to: a prefix slice when they are one
    (chains, and the causal default when no mask is given), else their indices (tree rows).
    `mask` is a 4-D boolean (True = attend) or additive float mask over [n, kv_len]."""
    if mask is None:
        return [slice(0, kv_len - n + i + 1) for i in range(n)]
    rows = mask.reshape(-1, mask.shape[-2], mask.shape[-1])[0]
    allowed = rows if rows.dtype == torch.bool else rows == 0
    plan: list[Visible] = []
    for i in range(n):
        idx = allowed[i].nonzero().flatten()
        count = int(idx.numel())
        if count == 0:
            raise ValueError(f"attention row {i} sees no key")
        if int(idx[-1]) == count - 1:  # 0..count-1: a prefix of the cache
            plan.append(slice(0, count))
        else:
            plan.append(idx)
    return plan


def _plan(mask: torch.Tensor | None, n: int, kv_len: int) -> list[Visible]:
    global _plan_memo
    memo_mask, memo_shape, memo_plan = _plan_memo
    if memo_mask is mask and memo_shape == (n, kv_len):  # the same forward's next layer
        return memo_plan
    plan = visible_keys(mask, n, kv_len)
    _plan_memo = (mask, (n, kv_len), plan)
    return plan


def _causal_mask(n: int, kv_len: int) -> torch.Tensor:
    q_pos = torch.arange(kv_len - n, kv_len)[:, None]
    return (torch.arange(kv_len)[None, :] <= q_pos)[None, None]


def row_invariant_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [b, heads, n, d], key/value [b, kv_heads,
    kv_len, d] (the cache included); returns [b, n, heads, d]. One sequence (b = 1): the
    backends feed one request at a time."""
    batch, heads, n, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if _batched.get():
        if attention_mask is None and kv_len != n:  # SDPA's is_causal aligns top-left
            attention_mask = _causal_mask(n, kv_len)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    if batch != 1:
        raise ValueError(f"row-invariant attention takes one sequence, got a batch of {batch}")
    group = heads // kv_heads
    out = query.new_empty(batch, n, heads, value.shape[-1])
    for i, keys in enumerate(_plan(attention_mask, n, kv_len)):
        # The queries sharing a key head become rows of one small product, as in decoding.
        q = query[:, :, i].reshape(batch, kv_heads, group, dim).contiguous()
        if isinstance(keys, slice):
            k, v = key[:, :, keys], value[:, :, keys]
        else:
            k, v = key.index_select(2, keys), value.index_select(2, keys)
        row = F.scaled_dot_product_attention(q, k, v, scale=scaling)
        out[:, i] = row.reshape(batch, heads, -1)
    return out, None


def row_invariance_supported(model: torch.nn.Module) -> bool:
    """Full causal attention in every layer: the row path reads no sliding window or padding
    mask (transformers builds none for a custom attention function)."""
    cfg = model.config
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return False
    return all(t == "full_attention" for t in (getattr(cfg, "layer_types", None) or []))


def use_row_invariant_attention(model: torch.nn.Module) -> None:
    """Switch a transformers model (in place) to row-invariant attention."""
    if not row_invariance_supported(model):
        raise ValueError(
            "row-invariant attention handles full causal attention only; this model has "
            "sliding-window layers"
        )
    # Registered here, not at import: importing transformers' attention registry costs
    # seconds, which every CLI command would pay before parsing its arguments.
    from transformers import AttentionInterface

    AttentionInterface.register(ROW_INVARIANT, row_invariant_attention)
    own: Any = model.config  # a transformers config
    own._attn_implementation = ROW_INVARIANT
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and cfg is not model.config and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = ROW_INVARIANT
