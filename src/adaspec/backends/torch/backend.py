"""Torch backend: a transformers causal LM driven with explicit positions and a KV cache."""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from adaspec.backends.base import ForwardOutput, ModelBackend
from adaspec.backends.torch.attention import batched_attention, use_row_invariant_attention
from adaspec.store.quant import prefill_arithmetic, quantized_bytes

if TYPE_CHECKING:
    from transformers import DynamicCache


class TorchBackend(ModelBackend):
    """Wraps a transformers CausalLM (Qwen2, Llama, ...) and owns its DynamicCache.

    The model is fed a custom 4-D boolean mask whenever a tree mask is given, so a flattened
    token tree is scored in one pass; otherwise transformers builds the causal mask itself.
    `row_invariant` switches attention to one decode-shaped call per query row
    (backends/torch/attention.py): with row-independent Linear layers (the quantized ones) a block's
    logits are then bit-identical to scoring its tokens one at a time. The switch belongs to
    the backend, not the model: another backend over the same model keeps batched attention.
    """

    def __init__(self, model: torch.nn.Module, name: str = "model",
                 row_invariant: bool = False) -> None:
        self.model = model.eval()
        self.name = name
        self.row_invariant = row_invariant
        if row_invariant:
            use_row_invariant_attention(self.model)
        cfg: Any = model.config  # a transformers config: its fields vary by architecture
        self.config = cfg
        self.vocab_size = int(cfg.vocab_size)
        self.max_context = int(getattr(cfg, "max_position_embeddings", 32768))
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.dtype = next(model.parameters()).dtype
        # where the weights are (`cpu` or `cuda`): inputs go there, logits come back to the CPU
        self.device = next(model.parameters()).device.type
        self.bytes_per_forward = self._weight_bytes_read()
        self._cache: DynamicCache | None = None
        self._len = 0
        self._norm_hook: Any = None  # `record_features`: the final norm's output
        self._normed: torch.Tensor | None = None

    has_features = True  # the decoder's final norm is read with a hook

    def record_features(self, on: bool) -> None:
        """Return the fed rows' final-normed states beside their logits (`features`):
        every row of a prompt too, since the norm runs on all of them."""
        if on and self._norm_hook is None:
            hf: Any = self.model

            def keep(module, args, output) -> None:
                self._normed = output[0] if isinstance(output, tuple) else output

            self._norm_hook = hf.get_decoder().norm.register_forward_hook(keep)
        elif not on and self._norm_hook is not None:
            self._norm_hook.remove()
            self._norm_hook = None
        self._normed = None

    def _weight_bytes_read(self) -> int:
        """Bytes of weights one forward reads: every parameter except the input embedding
        table (only the fed rows of it are touched)."""
        hf: Any = self.model  # a transformers model (or RestrictedHeadLM): these methods exist
        emb = hf.get_input_embeddings().weight
        out = hf.get_output_embeddings()
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        total += quantized_bytes(self.model)  # quantized layers keep weights in buffers
        if not hasattr(out, "weight") or emb.data_ptr() != out.weight.data_ptr():
            total -= emb.numel() * emb.element_size()
        return total

    @property
    def cache_len(self) -> int:
        return self._len

    def reset(self) -> None:
        from transformers import DynamicCache  # imported on first use: transformers is slow

        self._cache = DynamicCache(config=self.config)
        self._len = 0

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        hidden_layer: int | None = None,
    ) -> ForwardOutput:
        return self._run(tokens, positions, tree_mask, hidden_layer)

    def _run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None,
        tree_mask: torch.Tensor | None,
        hidden_layer: int | None,
        last_row_only: bool = False,
    ) -> ForwardOutput:
        if self._cache is None:
            self.reset()
        n = int(tokens.shape[-1])
        if positions is None:
            positions = torch.arange(self._len, self._len + n)
        mask = None
        if tree_mask is not None:
            if tree_mask.shape[-1] == self._len + n:  # also says which cached tokens to see
                full = tree_mask.to(torch.bool)
            else:
                full = torch.ones(n, self._len + n, dtype=torch.bool)
                full[:, self._len :] = tree_mask
            mask = full[None, None]
        if self.device != "cpu":
            tokens, positions = tokens.to(self.device), positions.to(self.device)
            mask = mask.to(self.device) if mask is not None else None
        # the model may be shared with a row-invariant backend: this one's switch decides
        with nullcontext() if self.row_invariant else batched_attention():
            out = self.model(
                input_ids=tokens.view(1, n),
                position_ids=positions.view(1, n),
                attention_mask=mask,
                past_key_values=self._cache,
                use_cache=True,
                output_hidden_states=hidden_layer is not None,
                logits_to_keep=1 if last_row_only else 0,
            )
        self._len += n
        hidden = None
        if hidden_layer is not None:
            if not 0 <= hidden_layer <= self.num_layers:
                raise ValueError(f"hidden_layer must be in [0, {self.num_layers}]")
            hidden = out.hidden_states[hidden_layer][0].cpu()
        features = None
        if self._norm_hook is not None and self._normed is not None:
            features, self._normed = self._normed[0].float().cpu(), None
        # logits stay on the device
        return ForwardOutput(logits=out.logits[0], hidden=hidden, features=features)

    @torch.inference_mode()
    def prefill(
        self, tokens: torch.Tensor, hidden_layer: int | None = None, reuse: int = 0
    ) -> ForwardOutput:
        """Reset and score a whole prompt, the output head on the last row only (what callers
        read); Linear layers run `prefill_arithmetic` (many rows) and attention is batched
        here (plain and speculative decoding share the prefill). Scores every token whatever
        `reuse` says."""
        self.reset()
        with prefill_arithmetic(self.model), batched_attention():
            return self._run(tokens, None, None, hidden_layer, last_row_only=True)

    def sequences(self, n: int) -> list[TorchBackend]:
        """`n` backends over these weights, each with its own cache: requests decoded
        together run one after the other (no batched kernels in this runtime)."""
        views = [TorchBackend(self.model, self.name, self.row_invariant) for _ in range(n)]
        for view in views:  # what a caller set on this one (a test's batch noise, say)
            view.__dict__.update({k: v for k, v in self.__dict__.items()
                                  if k in ("kind", "batch_noise")})
        return views

    def _layers(self) -> list:
        assert self._cache is not None
        return list(self._cache.layers)

    def truncate(self, length: int) -> None:
        if length >= self._len:
            return
        for layer in self._layers():
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]
        self._len = length

    def keep(self, indices: torch.Tensor) -> None:
        for layer in self._layers():
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                at = indices.to(layer.keys.device)
                layer.keys = layer.keys.index_select(-2, at)
                layer.values = layer.values.index_select(-2, at)
        self._len = int(indices.numel())
