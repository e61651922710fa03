"""A draft whose output head scores only a token subset: cheaper draft steps, exact output.

The head's rows for the kept ids are copied into a smaller Linear, so each draft step reads
N x hidden head weights instead of vocab x hidden; the decoder layers are shared with the
loaded model (no copy), so full-head and restricted drafters can run side by side in one
bench. Logits come back over the full vocabulary with -inf outside the set, so every drafter,
sampler and verifier works unchanged and sees a q that is exactly zero there, which
speculative sampling handles exactly (a target token outside the set is simply never
proposed, and is reached through the residual max(0, p - q) = p).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from adaspec.backends.base import ModelBackend
from adaspec.backends.torch.backend import TorchBackend
from adaspec.errors import InputError
from adaspec.store.quant import QuantLinear
from adaspec.store.token_set import load_token_set


class RestrictedHeadLM(torch.nn.Module):
    """Runs a causal LM's decoder, then a head sliced to `token_ids`; full-vocabulary logits."""

    token_ids: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, model: torch.nn.Module, token_ids: Sequence[int]) -> None:
        super().__init__()
        hf: Any = model  # a transformers CausalLM: config, get_output_embeddings, get_decoder
        if getattr(hf.config, "final_logit_softcapping", None):
            raise InputError("a restricted head does not support logit soft-capping models")
        head = hf.get_output_embeddings()
        self.decoder = hf.get_decoder()
        self.config = hf.config
        self.generation_config = getattr(model, "generation_config", None)
        self.full_vocab = int(head.out_features)
        ids = torch.tensor(sorted({int(t) for t in token_ids}), dtype=torch.long)
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= self.full_vocab:
            raise InputError(f"token set must be non-empty ids in [0, {self.full_vocab})")
        self.register_buffer("token_ids", ids, persistent=False)
        self.head: torch.nn.Module
        if isinstance(head, QuantLinear):  # a quantized draft: slice the quantized rows
            self.head = head.select_rows(ids)
            return
        self.head = torch.nn.Linear(
            head.in_features, ids.numel(), bias=head.bias is not None,
            dtype=head.weight.dtype, device=head.weight.device,
        )
        with torch.no_grad():
            self.head.weight.copy_(head.weight.index_select(0, ids))
            if head.bias is not None:
                self.head.bias.copy_(head.bias.index_select(0, ids))

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.decoder.get_input_embeddings()

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    def forward(
        self,
        input_ids: torch.Tensor,
        output_hidden_states: bool = False,
        logits_to_keep: int = 0,
        **kwargs,
    ):
        out = self.decoder(
            input_ids=input_ids, output_hidden_states=output_hidden_states, **kwargs
        )
        small = self.head(out.last_hidden_state[:, -logits_to_keep:])  # [batch, n, N]
        logits = small.new_full((*small.shape[:-1], self.full_vocab), float("-inf"))
        logits.index_copy_(-1, self.token_ids, small)
        return SimpleNamespace(logits=logits, hidden_states=out.hidden_states)


class RestrictedHeadBackend(TorchBackend):
    """A TorchBackend over RestrictedHeadLM: same cache handling, full vocab_size."""

    def __init__(self, model: torch.nn.Module, token_ids: Sequence[int], name: str) -> None:
        lm = RestrictedHeadLM(model, token_ids)
        super().__init__(lm, name=name)  # self.model is lm (eval() returns the module)
        self.vocab_size = lm.full_vocab
        self.token_ids = lm.token_ids


def restrict_head(backend: ModelBackend, token_ids: Sequence[int]) -> RestrictedHeadBackend:
    """A new draft backend over the same weights whose head keeps only `token_ids`."""
    model = getattr(backend, "model", None)
    if not isinstance(backend, TorchBackend) or model is None:
        raise InputError(
            "vocab=N restricts a torch draft model's output head; this draft is not one"
        )
    if isinstance(model, RestrictedHeadLM):
        raise InputError("the draft's output head is already restricted")
    return RestrictedHeadBackend(model, token_ids, name=backend.name)


def with_stored_vocab(backend: ModelBackend, size: int) -> ModelBackend:
    """The draft restricted to its stored top-`size` token set (size 0: unchanged)."""
    if size == 0:
        return backend
    token_set = load_token_set(backend.name, size, backend.vocab_size)
    return restrict_head(backend, token_set.token_ids)
