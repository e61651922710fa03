"""The sorted draft of S2D: the first layers of a Qwen2-style model with early exits.

Sub-model e is layers [0, exits[e]) followed by the shared final norm and output head, so
the smallest exit is a prefix of every larger one (Kavehzadeh et al., "S2D: Sorted
Speculative Decoding"). The decoder is adaspec's own (backends/torch/decoder.py), not
transformers', because drafting needs what a stock KV cache cannot give: per-segment caches
that run at different depths (`ExitState`).

The head may keep only a token subset (the rows of `token_ids`): each exit check reads
N x hidden head weights instead of vocab x hidden, and logits come back over the full
vocabulary with -inf elsewhere, so q is exactly zero outside the set and speculative
sampling stays exact.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from adaspec.backends.torch.decoder import DecoderLayer, RMSNorm, rope


@dataclass(frozen=True)
class SortedConfig:
    """Shapes of a sorted draft (a Qwen2 decoder's, cut to `exits[-1]` layers)."""

    vocab_size: int  # the full vocabulary (logits are returned over it)
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float
    rope_theta: float
    exits: tuple[int, ...]  # layer counts of the sub-models, ascending; the last = all layers

    def __post_init__(self) -> None:
        ex = tuple(self.exits)
        if not ex or list(ex) != sorted(set(ex)) or ex[0] < 1:
            raise ValueError(f"exits must be distinct layer counts >= 1, ascending: {ex}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide into heads, heads into kv heads")

    @property
    def num_layers(self) -> int:
        return self.exits[-1]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict:
        return {**asdict(self), "exits": list(self.exits)}

    @classmethod
    def from_dict(cls, d: dict) -> SortedConfig:
        return cls(**{**d, "exits": tuple(int(e) for e in d["exits"])})

    @classmethod
    def from_hf(cls, config, exits: tuple[int, ...]) -> SortedConfig:
        """From a transformers Qwen2/Llama-style config (rope_theta in either place)."""
        rope = getattr(config, "rope_parameters", None) or {}
        theta: Any = rope.get("rope_theta") if isinstance(rope, dict) else None
        theta = theta or getattr(config, "rope_theta", 10000.0)
        return cls(
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_heads=int(config.num_attention_heads),
            num_kv_heads=int(getattr(config, "num_key_value_heads", config.num_attention_heads)),
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(theta),
            exits=tuple(exits),
        )


class SortedDraftLM(nn.Module):
    """Embeddings, `exits[-1]` decoder layers, one final norm and one head for every exit."""

    token_ids: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, cfg: SortedConfig, token_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        ids = (torch.arange(cfg.vocab_size) if token_ids is None
               else torch.tensor(sorted({int(t) for t in token_ids.tolist()})))
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= cfg.vocab_size:
            raise ValueError(f"token ids must be a non-empty subset of [0, {cfg.vocab_size})")
        self.register_buffer("token_ids", ids, persistent=True)
        self.lm_head = nn.Linear(cfg.hidden_size, ids.numel(), bias=False)

    @property
    def device(self) -> torch.device:
        """Where the weights are (the target's device when drafting)."""
        return self.embed_tokens.weight.device

    @property
    def restricted(self) -> bool:
        return self.token_ids.numel() < self.config.vocab_size

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the kept tokens (columns in `token_ids` order)."""
        return self.lm_head(self.norm(hidden))

    def full_logits(self, small: torch.Tensor) -> torch.Tensor:
        """Kept-token logits -> full-vocabulary float logits, -inf outside the set."""
        if not self.restricted:
            return small.float()
        out = small.new_full((*small.shape[:-1], self.config.vocab_size), float("-inf"),
                             dtype=torch.float32)
        out.index_copy_(-1, self.token_ids, small.float())
        return out

    def exit_hidden(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced pass over whole sequences [b, n] from position 0: the hidden state
        at every exit, [b, n, hidden] each (training and tuning read these)."""
        cfg = self.config
        x = self.embed_tokens(input_ids)
        cos, sin = rope(torch.arange(input_ids.shape[-1], device=x.device), cfg.head_dim,
                        cfg.rope_theta, x.dtype)
        out: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x, _ = layer(x, cos, sin)
            if i + 1 in cfg.exits:
                out.append(x)
        return out


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None or a.shape[0] == 0 else torch.cat((a, b), dim=0)


class ExitState:
    """Incremental decoding with early exits; the deeper layers are filled lazily.

    A token that exits at sub-model e has no keys/values in the layers after exits[e], and
    a later token that goes deeper needs them. Here segment s (the layers between exit s - 1
    and exit s) keeps `pending[s]`: the hidden states, at its input, of the positions it has
    not run yet. When a token must go deeper, those positions run through the segment first,
    in the same batched pass as the token. Every cached key/value is then exactly what the
    full-depth model computes at that position, so each exit is a true sub-model of the
    prefix (what SoFT trains), not an approximation from a copied state; and on a CPU the
    batch costs no more than running the same positions one at a time. Rolling back is a
    truncation of each segment.
    """

    # RoPE is computed per position (no table bounds it); the Qwen2.5 sources were trained
    # to 32k positions, beyond which the draft's guesses would be worthless
    max_context = 32768

    def __init__(self, model: SortedDraftLM, exits: tuple[int, ...] | None = None) -> None:
        """exits: the exits to check (a subset of the model's, ascending; default all): with
        one, the sorted draft runs as a plain draft of that many layers."""
        self.model = model
        exits = tuple(exits or model.config.exits)
        if any(e not in model.config.exits for e in exits) or list(exits) != sorted(set(exits)):
            raise ValueError(f"exits {list(exits)} are not ascending exits of the model "
                             f"({list(model.config.exits)})")
        self.exits = exits
        bounds = (0, *exits)
        self.segments = [range(bounds[s], bounds[s + 1]) for s in range(len(exits))]
        self.reset()

    def reset(self) -> None:
        n = len(self.segments)
        self.total = 0  # positions fed
        self.done = [0] * n  # positions each segment has run (non-increasing in s)
        self.pending: list[torch.Tensor | None] = [None] * n  # inputs of [done[s], done[s-1])
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(
            self.model.layers)
        self.layers_run = 0  # layer-token evaluations (cost accounting)

    def _run_segment(self, s: int, x: torch.Tensor) -> torch.Tensor:
        """Run segment s on hidden inputs x [n, hidden] at positions done[s] on."""
        cfg = self.model.config
        n = x.shape[0]
        positions = torch.arange(self.done[s], self.done[s] + n, device=x.device)
        cos, sin = rope(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        h = x[None]
        for i in self.segments[s]:
            h, self.kv[i] = self.model.layers[i](h, cos, sin, self.kv[i])
        self.done[s] += n
        self.layers_run += n * len(self.segments[s])
        return h[0]

    @torch.inference_mode()
    def append(self, tokens: list[int], full_depth: bool = False) -> None:
        """Append `tokens` whose logits are not read (a prompt): through every segment
        (`full_depth`), or through the smallest sub-model only, the deeper segments running
        them when a later token first goes deeper."""
        x = self.model.embed_tokens(torch.tensor(tokens, device=self.model.device))
        self.total += len(tokens)
        h = self._run_segment(0, x)
        for s in range(1, len(self.segments)):
            if not full_depth:
                self.pending[s] = _cat(self.pending[s], h)
                return
            h = self._run_segment(s, _cat(self.pending[s], h))
            self.pending[s] = None

    @torch.inference_mode()
    def feed(self, tokens: list[int], thresholds: tuple[float, ...]
             ) -> tuple[int, torch.Tensor]:
        """Append `tokens`; run the last one through the sub-models from the smallest until
        one's top probability reaches its threshold (the last exit always answers). Returns
        (exit index, its kept-token logits [N]) for the next token."""
        model = self.model
        x = model.embed_tokens(torch.tensor(tokens, device=model.device))
        self.total += len(tokens)
        last = len(self.segments) - 1
        s = 0
        h = self._run_segment(0, x)
        while True:
            small = model.head_logits(h[-1])
            if s == last or confidence(small) >= thresholds[s]:
                if s < last:
                    self.pending[s + 1] = _cat(self.pending[s + 1], h)
                return s, small
            s += 1
            h = self._run_segment(s, _cat(self.pending[s], h))
            self.pending[s] = None

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions."""
        if length >= self.total:
            return
        above = self.total
        for s, seg in enumerate(self.segments):
            old = self.done[s]
            self.done[s] = min(old, length)
            p = self.pending[s]
            if p is not None:
                keep = max(0, min(above, length) - old)
                self.pending[s] = p[:keep] if keep else None
            for i in seg:
                kv = self.kv[i]
                if kv is not None:
                    self.kv[i] = (kv[0][..., : self.done[s], :], kv[1][..., : self.done[s], :])
            above = old
        self.total = length


def confidence(small_logits: torch.Tensor) -> float:
    """Top probability of a distribution given by logits (the exit rule's confidence); on a
    GPU the one number each exit tried reads back."""
    return float(torch.softmax(small_logits.float(), dim=-1).max())
