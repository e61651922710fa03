"""A feature-level draft head (EAGLE's shape): one decoder layer over the target's features.

At a position t the target has computed its feature f_t (the final-normed hidden state its
output head reads) and chosen the next token x_{t+1}. The head reads the pair
(f_t, embedding of x_{t+1}), fuses them into one vector (`fc`), runs one causal decoder layer
over its own past positions, and returns a hidden state shaped like the target's feature:
the target's own output head (restricted to the frequent tokens, `TokenHead`) turns it into
the distribution of x_{t+2}, and the hidden state stands in for f_{t+1} at the next draft
step. The token embeddings and the output head are the target's, read from its weights at
load; only `fc`, the layer and its norms are the head's own (what training changes and what
ships).

`features` > 1 fuses several of the target's layers instead of the last one (EAGLE-3's low,
middle and high features): `fc` then reads features * hidden + hidden numbers. Shapes on every
argument: B batch, T positions, H hidden.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import cache

import torch
from torch import nn

from adaspec.backends.torch.decoder import RMSNorm, rope, rope_frequencies, rotate_half


@dataclass(frozen=True)
class HeadConfig:
    hidden: int  # H: the target's hidden size
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the head layer's MLP width (the target's own is far wider)
    features: int = 1  # target feature vectors per position the head fuses
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_target(cls, config, intermediate: int, features: int = 1,
                    heads: int = 0) -> HeadConfig:
        """A head for a transformers Qwen2/Llama config (`config.json` of the target), with
        `heads` query heads of the target's size (0: as many as the target has; fewer cost
        less, a multiple of the target's key/value heads)."""
        rope_params = getattr(config, "rope_parameters", None) or {}
        theta = float(rope_params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        own = int(config.num_attention_heads)
        kv = int(getattr(config, "num_key_value_heads", own))
        if heads and heads % kv:
            raise ValueError(f"query heads must be a multiple of the {kv} key/value heads")
        return cls(hidden=int(config.hidden_size), heads=heads or own, kv_heads=kv,
                   head_dim=int(getattr(config, "head_dim", None)
                                or config.hidden_size // own),
                   intermediate=intermediate, features=features, rope_theta=theta,
                   rms_eps=float(getattr(config, "rms_norm_eps", 1e-6)))


@cache
def _frequencies(head_dim: int, theta: float, device: str) -> torch.Tensor:
    """`rope_frequencies` once per shape and device (a draft step is a few ms: its small ops
    count)."""
    return rope_frequencies(head_dim, theta, device)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, theta: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, heads, T, D] and k [B, kv_heads, T, D] rotated for positions [B, T] (Qwen2's
    rotate-half), the angles computed once for both."""
    b, t = positions.shape
    d = q.shape[-1]
    cos, sin = rope(positions.reshape(-1), d, theta, q.dtype,
                    _frequencies(d, theta, str(q.device)))
    cos, sin = cos.view(b, 1, t, d), sin.view(b, 1, t, d)
    return rotate_half(q, cos, sin), rotate_half(k, cos, sin)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An inference-only Linear holding `weight` [out, in] and `bias` (no initialisation)."""
    lin = nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0], bias=bias is not None,
                             dtype=weight.dtype)
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


class HeadLayer(nn.Module):
    """A Qwen2 decoder layer (biased q/k/v, grouped-query attention, SwiGLU MLP)."""

    fused: dict[str, nn.Module]

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden, cfg.head_dim
        self.input_norm = RMSNorm(h, cfg.rms_eps)
        self.q = nn.Linear(h, cfg.heads * d, bias=True)
        self.k = nn.Linear(h, cfg.kv_heads * d, bias=True)
        self.v = nn.Linear(h, cfg.kv_heads * d, bias=True)
        self.o = nn.Linear(cfg.heads * d, h, bias=False)
        self.post_norm = RMSNorm(h, cfg.rms_eps)
        self.gate = nn.Linear(h, cfg.intermediate, bias=False)
        self.up = nn.Linear(h, cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, h, bias=False)
        # `fuse()`: q/k/v and gate/up each as one product (inference only; kept out of the
        # module tree, so neither saved nor trained)
        self.__dict__["fused"] = {}

    def fuse(self) -> None:
        """Stack q/k/v and gate/up into one product each: at batch 1 a product costs its
        call as much as its bytes, and five calls become two (a draft step 15-20% shorter
        on 2 vCPUs). For inference: training the separate weights afterwards leaves these
        stale, so `unfuse` first. Already fused: kept (`quantize_fused` may have swapped
        them for quantized products)."""
        if self.fused or not all(type(m) is nn.Linear
                                 for m in (self.q, self.k, self.v, self.gate, self.up)):
            return  # fused already, or quantized apart (store/quant.py)
        with torch.no_grad():
            qkv = _linear(torch.cat([self.q.weight, self.k.weight, self.v.weight]),
                          torch.cat([self.q.bias, self.k.bias, self.v.bias]))
            gate_up = _linear(torch.cat([self.gate.weight, self.up.weight]), None)
        self.fused.update(qkv=qkv, gate_up=gate_up)

    def unfuse(self) -> None:
        self.fused.clear()

    def quantize_fused(self, quantize) -> None:
        """Swap the fused products for `quantize(nn.ModuleDict)`'s (in place): a quantized
        head keeps two products instead of five."""
        self.fuse()
        fused = nn.ModuleDict(self.fused)
        quantize(fused)
        self.fused.update(dict(fused.items()))

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B, T, H] at positions [B, T]; past: keys and values [B, kv_heads, S, D] of the
        S positions before (None: none); mask [T, S + T] bool (None: causal over past + x).
        Returns the layer's output [B, T, H] and the keys and values [B, kv_heads, S + T, D]."""
        cfg = self.cfg
        b, t, _ = x.shape
        y = self.input_norm(x)
        if self.fused:
            qkv = self.fused["qkv"](y)
            nq, nk = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
            q_, k_, v_ = qkv.split([nq, nk, nk], -1)
        else:
            q_, k_, v_ = self.q(y), self.k(y), self.v(y)
        q = q_.reshape(b, t, cfg.heads, cfg.head_dim).transpose(1, 2)
        k = k_.reshape(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        v = v_.reshape(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = rotary(q, k, positions, cfg.rope_theta)
        if past is not None:
            k = torch.cat([past[0], k], 2)
            v = torch.cat([past[1], v], 2)
        if mask is None and t > 1:  # one new position sees everything: no mask
            s = k.shape[2] - t
            mask = torch.ones(t, s + t, dtype=torch.bool, device=x.device).tril(s)
        att = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(cfg.head_dim), enable_gqa=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, cfg.heads * cfg.head_dim))
        y = self.post_norm(x)
        if self.fused:
            gate, up = self.fused["gate_up"](y).chunk(2, -1)
        else:
            gate, up = self.gate(y), self.up(y)
        x = x + self.down(nn.functional.silu(gate) * up)
        return x, (k, v)


class DraftHead(nn.Module):
    """fc over (features, token embedding), one decoder layer, a final norm: [B, T, H]."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear((cfg.features + 1) * cfg.hidden, cfg.hidden, bias=False)
        self.layer = HeadLayer(cfg)
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """features [B, T, features * H] (the target's at t, or the head's own output for a
        drafted position), embeds [B, T, H] (the token after t), positions [B, T] (t + 1).
        Returns the next feature's stand-in [B, T, H] (final-normed, as the target's output
        head reads it) and the layer's keys and values."""
        x = self.fc(torch.cat([features, embeds], -1))
        x, kv = self.layer(x, positions, past, mask)
        return self.norm(x), kv


class TokenHead(nn.Module):
    """The target's output head restricted to `token_ids` (FR-Spec): logits over the kept
    tokens [..., N], or over the full vocabulary with -inf elsewhere (`full_logits`), so a
    draw from it gives q = 0 outside the kept set and speculative sampling stays exact."""

    token_ids: torch.Tensor

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor, vocab: int) -> None:
        """weight [N, H]: the target's output rows of `token_ids` [N] (sorted ids)."""
        super().__init__()
        # a Linear, so the weight quantizations of `store/quant.py` apply to it
        self.proj = nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                              dtype=weight.dtype)
        self.proj.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("token_ids", token_ids, persistent=False)
        self.vocab = vocab

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden)

    def full_logits(self, small: torch.Tensor) -> torch.Tensor:
        """[..., N] kept-token logits -> [..., vocab], -inf outside the kept set."""
        full = small.new_full((*small.shape[:-1], self.vocab), float("-inf"))
        full[..., self.token_ids] = small
        return full
