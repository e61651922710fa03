"""The draft as it learns: a float copy whose last decoder layers and final norm train while
the layers below stay frozen.

Why the last layers and not LoRA (docs/osd.md, measured on this CPU): the frozen layers'
output (the "boundary") depends only on the tokens, so it is computed once per sequence,
without gradients, and reused by every later step and update; a step then runs and
back-propagates through two layers and the head instead of the whole network. LoRA adapters
on every layer need a backward pass through all of them at every step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, cast

import torch
from torch import nn

from adaspec.errors import InputError


class DecoderStack(Protocol):
    """What the student reads of a transformers decoder stack (`model.model`)."""

    embed_tokens: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    rotary_emb: nn.Module


def decoder_of(model: nn.Module) -> DecoderStack:
    """The decoder stack (`model.model` of a transformers causal LM: embed_tokens, layers,
    norm, rotary_emb)."""
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        raise InputError("online distillation needs a transformers decoder model (Qwen2, "
                         "Llama...) as the draft")
    return inner


def trainable_names(model: nn.Module, layers: int) -> list[str]:
    """Parameter names of the last `layers` decoder layers and the final norm."""
    inner = decoder_of(model)
    total = len(inner.layers)
    if not 1 <= layers <= total:
        raise InputError(f"the draft has {total} layers: train between 1 and {total}, "
                         f"not {layers}")
    prefixes = tuple(f"model.layers.{i}." for i in range(total - layers, total))
    names = [n for n, _ in model.named_parameters()
             if n.startswith(prefixes) or n.startswith("model.norm.")]
    # quantized Linear layers keep their weights in buffers: name them as weights
    for path, mod in model.named_modules():
        if path.startswith(prefixes) and hasattr(mod, "dense") and hasattr(mod, "mode"):
            names.append(f"{path}.weight")
    return sorted(set(names))


def causal_mask(n: int, dtype: torch.dtype, device: torch.device | str = "cpu"
                ) -> torch.Tensor:
    mask = torch.full((n, n), float("-inf"), dtype=dtype, device=device).triu(1)
    return mask[None, None]


class Student:
    """Wraps a float transformers causal LM (its own copy: training changes it), trained
    where its weights are (a GPU's spare compute when loaded there); `state` is on the CPU."""

    def __init__(self, model: nn.Module, layers: int, cache_size: int = 256) -> None:
        self.model = model.float().eval()
        self.device = next(model.parameters()).device
        self.inner = decoder_of(model)
        self.split = len(self.inner.layers) - layers
        self.layers = layers
        self.names = trainable_names(model, layers)
        params = dict(model.named_parameters())
        for p in model.parameters():
            p.requires_grad_(False)
        self.params = [params[n] for n in self.names]
        for p in self.params:
            p.requires_grad_(True)
        self.cache_size = cache_size
        self._boundaries: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()

    # ------------------------------------------------------------------ forward
    def _run(self, hidden: torch.Tensor, layers: Sequence[nn.Module]) -> torch.Tensor:
        n = hidden.shape[1]
        positions = torch.arange(n, device=self.device)[None]
        rope = self.inner.rotary_emb(hidden, positions)
        mask = causal_mask(n, hidden.dtype, self.device)
        for layer in layers:
            out = layer(hidden, attention_mask=mask, position_ids=positions,
                        position_embeddings=rope)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def boundary(self, tokens: Sequence[int], cache: bool = True) -> torch.Tensor:
        """The frozen layers' output for `tokens` [1, T, H] (cached per sequence)."""
        key = tuple(tokens)
        hit = self._boundaries.get(key)
        if hit is not None:
            self._boundaries.move_to_end(key)
            return hit
        with torch.no_grad():
            hidden = self.inner.embed_tokens(torch.tensor([list(tokens)], device=self.device))
            hidden = self._run(hidden, list(self.inner.layers)[: self.split])
        if cache:
            self._boundaries[key] = hidden
            while len(self._boundaries) > self.cache_size:
                self._boundaries.popitem(last=False)
        return hidden

    def log_probs(self, tokens: Sequence[int], positions: Sequence[int],
                  cache: bool = True) -> torch.Tensor:
        """log q(. | tokens[:p]) for each position p, over the vocabulary [n, V], with
        gradients to the trainable layers when grad is enabled."""
        end = max(positions)
        hidden = self.boundary(tokens, cache)[:, :end]
        hidden = self._run(hidden, list(self.inner.layers)[self.split:])
        rows = self.inner.norm(hidden)[0, [p - 1 for p in positions]]
        head = cast(nn.Module, self.model.lm_head)
        return torch.log_softmax(head(rows).float(), dim=-1)

    @torch.no_grad()
    def predictions(self, tokens: Sequence[int], start: int) -> torch.Tensor:
        """The draft's greedy guess of tokens[p] for p = start .. len(tokens) - 1."""
        positions = list(range(start, len(tokens)))
        if not positions:
            return torch.zeros(0, dtype=torch.int64)
        return self.log_probs(tokens, positions).argmax(-1).cpu()

    # ------------------------------------------------------------------ weights
    def state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in zip(self.names, self.params,
                                                             strict=True)}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self.names) - set(state)
        if missing:
            raise InputError(f"adapter lacks {len(missing)} tensors (e.g. {min(missing)}): "
                             "it was made for another draft or layer count")
        with torch.no_grad():
            for n, p in zip(self.names, self.params, strict=True):
                p.copy_(state[n].to(p.dtype))

    def finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.params)


def apply_to_serving(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a student's trainable tensors into a serving draft model (float or quantized
    Linear layers), in place. Called between requests only."""
    from adaspec.store.quant import set_linear_weight

    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, tensor in state.items():
            if name in params and not _is_quant_weight(model, name):
                params[name].copy_(tensor.to(params[name].dtype))
                continue
            path, _, attr = name.rpartition(".")
            if attr != "weight":
                raise InputError(f"adapter tensor {name} has no place in the serving draft")
            set_linear_weight(model, path, tensor)


def _is_quant_weight(model: nn.Module, name: str) -> bool:
    path, _, attr = name.rpartition(".")
    try:
        mod = model.get_submodule(path)
    except AttributeError:
        return False
    return attr == "weight" and hasattr(mod, "mode") and hasattr(mod, "dense")
