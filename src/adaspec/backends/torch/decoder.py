"""The Qwen2 / Llama decoder, written once: RMSNorm, rotary embeddings, grouped-query
attention and the gated MLP, with transformers' parameter names (checkpoints load as they
are). Two runtimes use it: the S2D sorted draft (draft/sorted_model.py: growing caches per
exit segment) and the static-cache torch runtime (backends/torch/static.py: preallocated
keys and values, explicit positions, tree masks).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class LayerShapes(Protocol):
    """What a decoder layer reads of a model's config."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def head_dim(self) -> int: ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_frequencies(head_dim: int, theta: float, device: torch.device | str = "cpu"
                     ) -> torch.Tensor:
    """[head_dim / 2] float32: the rotary angle per position of each pair of dimensions."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (theta ** exps)


def rope(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
         inv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, head_dim] for absolute positions (the rotate-half convention), where
    `positions` are; `inv`: `rope_frequencies` computed once on that device."""
    if inv is None:
        inv = rope_frequencies(head_dim, theta, positions.device)
    freqs = positions.float()[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by the angles whose cos and sin are given (the rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: LayerShapes) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        bias = getattr(cfg, "attention_bias", True)  # Qwen2: q/k/v biases; Llama: none
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # once fused

    def fuse(self) -> None:
        """q, k and v in one matrix product (one read of x, one kernel instead of three:
        0.30 ms of a 1.5B pass on the H200). The three weights become views into one
        tensor, so their names, a checkpoint's, still reach them (an adapter written into
        `q_proj.weight` lands in the fused product)."""
        self.qkv = _fuse(self.q_proj, self.k_proj, self.v_proj)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, n, hidden] -> q [b, heads, n, d], k and v [b, kv_heads, n, d]."""
        b, n, _ = x.shape
        d = self.head_dim
        if self.qkv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = F.linear(x, *self.qkv).split(
                [self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        return (q.reshape(b, n, self.heads, d).transpose(1, 2),
                k.reshape(b, n, self.kv_heads, d).transpose(1, 2),
                v.reshape(b, n, self.kv_heads, d).transpose(1, 2))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [b, n, hidden]; past: keys/values [b, kv_heads, L, d] of earlier positions.
        The new tokens see the whole past and each other causally."""
        b, n, _ = x.shape
        q, k, v = self._qkv(x)
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        if past is not None and past[0].shape[-2]:
            k = torch.cat((past[0], k), dim=-2)
            v = torch.cat((past[1], v), dim=-2)
        total = k.shape[-2]
        gqa = self.heads != self.kv_heads  # grouped heads read shared keys, not copies
        if n == 1:
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        elif total == n:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            mask = torch.ones(n, total, dtype=torch.bool, device=x.device).tril(total - n)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        out = out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim)
        return self.o_proj(out), (k, v)

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             cache: tuple[torch.Tensor, torch.Tensor], start: int, mask: torch.Tensor,
             slots: torch.Tensor | None = None) -> torch.Tensor:
        """A static cache's pass: x [b, n, hidden] at cache slots start .. start + n (their
        rotary positions are in cos / sin [n, d], a tree's need not be consecutive); cache:
        keys/values [b, kv_heads, max_len, d], written in place; mask [n, start + n] bool,
        True where a new token sees a slot.

        Fixed shapes (what a captured graph replays): slots [b, n], the slots each row's
        tokens write (a tensor, read at replay), cos / sin [b, n, d], and the mask
        [b, 1, n, span] (or [n, span] for one row) over the first `span` slots of every
        row, so every shape depends on b, n and span alone."""
        b, n, _ = x.shape
        q, k, v = self._qkv(x)
        if cos.dim() == 3:  # a rotary angle per row
            cos, sin = cos[:, None], sin[:, None]
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        keys, values = cache
        if slots is None:
            keys[:, :, start : start + n] = k
            values[:, :, start : start + n] = v
            keys, values = keys[:, :, : start + n], values[:, :, : start + n]
        else:
            rows = torch.arange(b, device=slots.device)[:, None].expand(b, n)
            keys.transpose(1, 2)[rows, slots] = k.transpose(1, 2)  # [b, n, kv_heads, d]
            values.transpose(1, 2)[rows, slots] = v.transpose(1, 2)
            span = mask.shape[-1]
            keys, values = keys[:, :, :span], values[:, :, :span]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=self.heads != self.kv_heads)
        out = out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim)
        return self.o_proj(out)


    def step_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache: tuple[torch.Tensor, torch.Tensor], rows: list[Row]) -> torch.Tensor:
        """Several sequences' passes at once: x [B, n, hidden], row b's first m_b tokens real
        (their rotary cos / sin [B, n, d]); cache: keys/values [S, kv_heads, max_len, d], one
        row per sequence, written in place. The projections run over every row in one
        matrix product (the weights are read once); attention runs per row over its own
        sequence's cache. Padding tokens' outputs are zeros (nothing reads them)."""
        b, n, _ = x.shape
        q, k, v = self._qkv(x)
        cos, sin = cos[:, None], sin[:, None]
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        keys, values = cache
        out = q.new_zeros(b, self.heads, n, self.head_dim)
        for r, row in enumerate(rows):
            seq, start, m = row.seq, row.start, row.tokens
            keys[seq, :, start : start + m] = k[r, :, :m]
            values[seq, :, start : start + m] = v[r, :, :m]
            out[r, :, :m] = F.scaled_dot_product_attention(
                q[r : r + 1, :, :m], keys[seq : seq + 1, :, : start + m],
                values[seq : seq + 1, :, : start + m], attn_mask=row.mask,
                enable_gqa=self.heads != self.kv_heads)[0]
        out = out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim)
        return self.o_proj(out)


def _fuse(*parts: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One weight (and bias) for several Linear layers over the same input, their own
    parameters made views into it (so nothing is stored twice and in-place writes to them
    reach the fused product); None where they are not plain Linear layers (quantized)."""
    if not all(type(p) is nn.Linear for p in parts):
        return None
    linears = [p for p in parts if isinstance(p, nn.Linear)]
    weight = torch.cat([p.weight.detach() for p in linears])
    bias = (torch.cat([p.bias.detach() for p in linears])
            if all(p.bias is not None for p in linears) else None)
    at = 0
    for p in linears:
        rows = p.weight.shape[0]
        p.weight.data = weight[at : at + rows]
        if bias is not None:
            p.bias.data = bias[at : at + rows]
        at += rows
    return weight, bias


class Row(NamedTuple):
    """One sequence's share of a batched pass: its cache row, cached length before the
    pass, real tokens, and their mask [tokens, start + tokens] (causal after the cache)."""

    seq: int
    start: int
    tokens: int
    mask: torch.Tensor


class MLP(nn.Module):
    def __init__(self, cfg: LayerShapes) -> None:
        super().__init__()
        h, m = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, m, bias=False)
        self.up_proj = nn.Linear(h, m, bias=False)
        self.down_proj = nn.Linear(m, h, bias=False)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # once fused

    def fuse(self) -> None:
        """gate and up in one matrix product (as `Attention.fuse`)."""
        self.gate_up = _fuse(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, *self.gate_up).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """One Qwen2 decoder layer; parameter names match transformers' checkpoints."""

    def __init__(self, cfg: LayerShapes) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fuse(self) -> None:
        """Fewer, larger matrix products for a runtime that owns these weights."""
        self.self_attn.fuse()
        self.mlp.fuse()

    def forward(self, x, cos, sin, past=None):
        attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, past)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             cache: tuple[torch.Tensor, torch.Tensor], start: int, mask: torch.Tensor,
             slots: torch.Tensor | None = None) -> torch.Tensor:
        """The layer on a static cache (`Attention.step`)."""
        x = x + self.self_attn.step(self.input_layernorm(x), cos, sin, cache, start, mask,
                                    slots)
        return x + self.mlp(self.post_attention_layernorm(x))

    def step_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache: tuple[torch.Tensor, torch.Tensor], rows: list[Row]) -> torch.Tensor:
        """The layer over several sequences' rows (`Attention.step_rows`)."""
        x = x + self.self_attn.step_rows(self.input_layernorm(x), cos, sin, cache, rows)
        return x + self.mlp(self.post_attention_layernorm(x))
