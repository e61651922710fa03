"""The static-cache torch runtime (`--weights static`), shaped after gpt-fast: adaspec's own
Qwen2 / Llama decoder (backends/decoder.py) over keys and values preallocated for
`max_context` positions. A pass writes its tokens' entries at the slots after the cache and
reads them back under an explicit mask; a rollback moves a length (nothing is freed or
copied), a tree's accepted path is gathered to the front. Tokens carry explicit rotary
positions, so a flattened token tree is scored in one pass.

It runs on the CPU and on a CUDA GPU alike (same code; tests run it on the CPU with tiny
models). The weights are a transformers checkpoint's (a local Hugging Face directory of a
Qwen2 / Llama-family model, or a built-in model), loaded as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from adaspec.backends.base import ForwardOutput, ModelBackend, reusable_prefix
from adaspec.backends.decoder import DecoderLayer, RMSNorm, rope
from adaspec.errors import InputError

STATIC = "static"  # the weights variant: the model's own dtype, this runtime
DEFAULT_CONTEXT = 8192  # positions
# cache slots beyond max_context: a token tree near the limit fits its positions (the
# engine cuts it by depth) while its nodes take a slot each
TREE_SLOTS = 512
ARCHITECTURES = ("qwen2", "llama")


@dataclass(frozen=True)
class DecoderConfig:
    """A Qwen2 / Llama decoder's shapes."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool  # Qwen2: q/k/v biases; Llama: none

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, config: Any) -> DecoderConfig:
        """From a transformers config; InputError for what this decoder does not compute
        (another architecture, sliding windows, rotary scaling)."""
        kind = getattr(config, "model_type", "?")
        if kind not in ARCHITECTURES:
            raise InputError(f"the static runtime runs {' and '.join(ARCHITECTURES)} models, "
                             f"not {kind!r}")
        if getattr(config, "use_sliding_window", False):
            raise InputError("the static runtime has no sliding-window attention")
        rope_cfg = getattr(config, "rope_parameters", None) or getattr(
            config, "rope_scaling", None) or {}
        scaling = rope_cfg.get("rope_type", "default") if isinstance(rope_cfg, dict) else None
        if scaling not in (None, "default"):
            raise InputError(f"the static runtime has no {scaling!r} rotary scaling")
        theta = rope_cfg.get("rope_theta") if isinstance(rope_cfg, dict) else None
        head_dim = getattr(config, "head_dim", None)
        if head_dim and head_dim * config.num_attention_heads != config.hidden_size:
            raise InputError("the static runtime needs head_dim x heads == hidden_size")
        return cls(
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_heads=int(config.num_attention_heads),
            num_kv_heads=int(getattr(config, "num_key_value_heads", None)
                             or config.num_attention_heads),
            num_layers=int(config.num_hidden_layers),
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(theta or getattr(config, "rope_theta", None) or 10000.0),
            attention_bias=bool(getattr(config, "attention_bias", kind == "qwen2")),
        )


class DecoderLM(nn.Module):
    """Embeddings, decoder layers, final norm, output head (transformers' names without
    the `model.` prefix)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @classmethod
    def from_hf(cls, hf_model: nn.Module) -> DecoderLM:
        """The same weights as a transformers causal LM (shared, not copied: the module
        keeps the checkpoint's tensors and dtype)."""
        cfg = DecoderConfig.from_hf(hf_model.config)
        with torch.device("meta"):
            model = cls(cfg)
        state = {k.removeprefix("model."): v for k, v in hf_model.state_dict().items()
                 if "rotary_emb" not in k}
        if "lm_head.weight" not in state:  # tied embeddings
            state["lm_head.weight"] = state["embed_tokens.weight"]
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval()


class StaticTorchBackend(ModelBackend):
    """A DecoderLM with a preallocated KV cache [1, kv_heads, max_context + TREE_SLOTS,
    head_dim] per layer; chains and token trees, rollback by length."""

    kind = "torch-static"
    supports_trees = True
    has_hidden_states = True

    def __init__(self, model: DecoderLM, name: str = "model",
                 max_context: int = DEFAULT_CONTEXT) -> None:
        self.model = model.eval()
        self.name = name
        cfg = model.config
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.num_layers = cfg.num_layers
        self.hidden_size = cfg.hidden_size
        self.max_context = int(max_context)
        weight = model.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device.type
        # every weight a pass reads: the embedding table only where it is the head too
        self.bytes_per_forward = sum(p.numel() * p.element_size() for p in model.parameters())
        if model.lm_head.weight is not weight:
            self.bytes_per_forward -= weight.numel() * weight.element_size()
        shape = (1, cfg.num_kv_heads, self.max_context + TREE_SLOTS, cfg.head_dim)
        self._cache = [(torch.zeros(shape, dtype=self.dtype, device=weight.device),
                        torch.zeros(shape, dtype=self.dtype, device=weight.device))
                       for _ in range(cfg.num_layers)]
        self._len = 0
        self._ids: list[int] = []  # the cached tokens (prefix reuse)

    @property
    def cache_len(self) -> int:
        return self._len

    def reset(self) -> None:
        self._len = 0
        self._ids = []

    def truncate(self, length: int) -> None:
        self._len = min(self._len, max(0, int(length)))
        del self._ids[self._len :]

    def keep(self, indices: torch.Tensor) -> None:
        """Keep the cached slots `indices` (ascending), gathered to the front."""
        at = indices.reshape(-1).to(torch.long)
        n = int(at.numel())
        if n and (int(at[-1]) >= self._len or bool((at[1:] <= at[:-1]).any())):
            raise InputError("keep: indices must be ascending cached positions")
        if at.tolist() != list(range(n)):
            dev = at.to(self._cache[0][0].device)
            for keys, values in self._cache:
                keys[:, :, :n] = keys[:, :, dev].clone()
                values[:, :, :n] = values[:, :, dev].clone()
            self._ids = [self._ids[i] for i in at.tolist()] if len(self._ids) >= self._len \
                else []
        else:
            del self._ids[n:]
        self._len = n

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        hidden_layer: int | None = None,
    ) -> ForwardOutput:
        return self._run(tokens, positions, tree_mask, hidden_layer, last_row_only=False)

    @torch.inference_mode()
    def prefill(
        self, tokens: torch.Tensor, hidden_layer: int | None = None, reuse: int = 0
    ) -> ForwardOutput:
        """Score a prompt, the output head on its last row only; up to `reuse` leading
        tokens the cache already holds are kept (at least the last one is scored)."""
        ids = [int(t) for t in tokens.reshape(-1)]
        if not ids:
            raise InputError("empty prompt")
        kept = reusable_prefix(self._ids, ids, reuse)
        self.truncate(kept)
        return self._run(torch.tensor(ids[kept:]), None, None, hidden_layer,
                         last_row_only=True)

    def _mask(self, n: int, tree_mask: torch.Tensor | None) -> torch.Tensor:
        """[n, len + n] bool: what each new token sees (the cache, then the new tokens
        causally or by the tree's mask; a mask as wide as the whole says it all)."""
        start = self._len
        if tree_mask is not None and tree_mask.shape[-1] == start + n:
            return tree_mask.to(torch.bool)
        mask = torch.ones(n, start + n, dtype=torch.bool)
        if tree_mask is None:
            mask[:, start:] = torch.ones(n, n, dtype=torch.bool).tril()
        else:
            mask[:, start:] = tree_mask.to(torch.bool)
        return mask

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor | None,
             tree_mask: torch.Tensor | None, hidden_layer: int | None,
             last_row_only: bool) -> ForwardOutput:
        ids = tokens.reshape(-1).to(torch.long)
        n, start = int(ids.numel()), self._len
        if n == 0:
            raise InputError("no tokens to score")
        pos = positions.reshape(-1) if positions is not None else torch.arange(start, start + n)
        last = int(pos.max())
        if last >= self.max_context or start + n > self.max_context + TREE_SLOTS:
            raise InputError(f"context too long for the static runtime: "
                             f"{max(last + 1, start + n)} > {self.max_context} tokens")
        if hidden_layer is not None and not 0 <= hidden_layer <= self.num_layers:
            raise InputError(f"hidden_layer must be in [0, {self.num_layers}]")
        cfg, model, dev = self.config, self.model, self._cache[0][0].device
        mask = self._mask(n, tree_mask).to(dev)
        cos, sin = rope(pos, cfg.head_dim, cfg.rope_theta, self.dtype)
        cos, sin = cos.to(dev), sin.to(dev)
        x = model.embed_tokens(ids.to(dev))[None]
        hidden = x[0] if hidden_layer == 0 else None
        layer: Any
        for i, layer in enumerate(model.layers):
            x = layer.step(x, cos, sin, self._cache[i], start, mask)
            if hidden_layer is not None and i + 1 == hidden_layer < self.num_layers:
                hidden = x[0]
        x = model.norm(x)
        if hidden_layer == self.num_layers:
            hidden = x[0]
        rows = x[0, -1:] if last_row_only else x[0]
        logits = model.lm_head(rows)
        self._len += n
        del self._ids[start:]
        self._ids.extend(ids.tolist())
        return ForwardOutput(logits=logits.cpu(),
                             hidden=hidden.cpu() if hidden is not None else None)


def static_backend(hf_model: nn.Module, name: str, device: str = "cpu",
                   max_context: int = DEFAULT_CONTEXT) -> StaticTorchBackend:
    """A transformers causal LM's weights in the static runtime on `device`."""
    model = DecoderLM.from_hf(hf_model).to(device)
    limit = int(getattr(hf_model.config, "max_position_embeddings", max_context))
    return StaticTorchBackend(model, name, min(max_context, limit))
