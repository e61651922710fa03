"""The static-cache torch runtime (`--weights static`), shaped after gpt-fast: adaspec's own
Qwen2 / Llama decoder (backends/torch/decoder.py) over keys and values preallocated for
`max_context` positions. A pass writes its tokens' entries at the slots after the cache and
reads them back under an explicit mask; a rollback moves a length (nothing is freed or
copied), a tree's accepted path is gathered to the front. Tokens carry explicit rotary
positions, so a flattened token tree is scored in one pass.

Passes of up to 64 tokens after the prompt (decode, verification, tree shapes) can run at
fixed shapes (`graphs`): padded to 1, 2, 4, ..., 64 tokens, the padding written to scratch
slots past the cache, attention and its mask over the cache's first `span` slots (a power of
two covering the pass, at least MIN_SPAN), so every tensor's shape depends on the padded
size and the span alone. On a GPU each (size, span) is captured once as a CUDA graph and
replayed (one launch instead of hundreds of small ones, which otherwise cost more than the
pass); on the CPU the same fixed-shape pass runs eagerly, which is how tests check it. The
span keeps a pass from reading the empty slots of a long cache: on the H200 a verification
pass of 4 tokens after 512 cost 9.4 ms over all 8,768 slots of the default cache and 5.4
over 1,280 (experiments/results/gpu-h200-parts).
With `compile` (`ADASPEC_TORCH_COMPILE=1` where the runtime is loaded by name) each fixed
pass is compiled by torch.compile first, which fuses its small kernels (norms, rotary,
activations); a compiler that fails leaves the eager pass.

It runs on the CPU and on a CUDA GPU alike (same code; tests run it on the CPU with tiny
models). The weights are a transformers checkpoint's (a local Hugging Face directory of a
Qwen2 / Llama-family model, or a built-in model), loaded as they are.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from adaspec.backends.base import ForwardOutput, ModelBackend, reusable_prefix
from adaspec.backends.torch.decoder import DecoderLayer, RMSNorm, rope, rope_frequencies
from adaspec.backends.torch.graphs import PassInputs, capture_graph
from adaspec.errors import InputError

DEFAULT_CONTEXT = 8192  # positions
# cache slots beyond max_context: a token tree near the limit fits its positions (the
# engine cuts it by depth) while its nodes take a slot each
TREE_SLOTS = 512
# cached slots just before a fixed pass that its mask may hide: a draft tree's levels fed
# so far, of which each new node sees its ancestors only (more: the exact-shape pass)
BAND = 64
MIN_SPAN = 256  # the shortest attention span of a fixed pass (slots)
ARCHITECTURES = ("qwen2", "llama")
GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64)  # the fixed pass sizes (tokens, padding included)
# graphs: "cuda" captures a CUDA graph per size, "eager" runs the fixed-shape pass without
# one (the CPU's way to test it), "off" the exact-size pass; "auto": cuda on a GPU, else off
GRAPH_MODES = ("auto", "cuda", "eager", "off")


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


class DecoderStack(nn.Module):
    """Embeddings, decoder layers, final norm (a transformers causal LM's `model`)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    """The decoder stack and the output head under transformers' own parameter names
    (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`), so a checkpoint's state
    and an online-distillation adapter (online/student.py) load as they are."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @classmethod
    def from_hf(cls, hf_model: nn.Module) -> DecoderLM:
        """The same weights as a transformers causal LM (shared, not copied: the module
        keeps the checkpoint's tensors and dtype)."""
        cfg = DecoderConfig.from_hf(hf_model.config)
        with torch.device("meta"):
            model = cls(cfg)
        state = {k: v for k, v in hf_model.state_dict().items() if "rotary_emb" not in k}
        if "lm_head.weight" not in state:  # tied embeddings
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        if "lm_head.bias" in state:  # an output head with a bias (a replaced head)
            with torch.device("meta"):
                model.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=True)
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval()


class StaticTorchBackend(ModelBackend):
    """A DecoderLM with a preallocated KV cache [1, kv_heads, max_context + TREE_SLOTS,
    head_dim] per layer; chains and token trees, rollback by length."""

    kind = "torch-static"
    supports_trees = True
    has_hidden_states = True
    has_features = True  # the final norm's output rows, from the pass itself (a head's input)

    def __init__(self, model: DecoderLM, name: str = "model",
                 max_context: int = DEFAULT_CONTEXT, graphs: str = "auto",
                 compile: bool = False) -> None:
        self.model = model.eval()
        for layer in model.model.layers:  # q/k/v and gate/up as one product each
            cast(DecoderLayer, layer).fuse()
        self.name = name
        cfg = model.config
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.num_layers = cfg.num_layers
        self.hidden_size = cfg.hidden_size
        self.max_context = int(max_context)
        weight = model.model.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device.type
        # every weight a pass reads: the embedding table only where it is the head too
        self.bytes_per_forward = sum(p.numel() * p.element_size() for p in model.parameters())
        if model.lm_head.weight is not weight:
            self.bytes_per_forward -= weight.numel() * weight.element_size()
        if graphs not in GRAPH_MODES:
            raise InputError(f"graphs must be one of {', '.join(GRAPH_MODES)}, got {graphs!r}")
        if graphs == "auto":
            graphs = "cuda" if self.device == "cuda" else "off"
        if graphs == "cuda" and self.device != "cuda":
            raise InputError("CUDA graphs need the model on a CUDA GPU")
        self.graphs = graphs
        if compile and graphs == "off":
            raise InputError("compile applies to the fixed-shape passes: graphs cuda or eager")
        # torch.compile fuses each fixed pass's small kernels (norms, rotary, activations);
        # compiled once per size on first use, then captured like the eager pass
        self.compiled = compile
        if compile:  # one compiled graph per pass size and model (a target and a draft in
            # one process: 2 x 7 sizes, past dynamo's default limit of 8 per code object)
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
        # the span is a dynamic dimension (`_FixedPass.at`): one compiled graph serves a
        # size at every span
        self._pass = (torch.compile(self._fixed_pass, fullgraph=True)
                      if compile else self._fixed_pass)
        # scratch slots past the cache: a fixed pass writes its padding there
        self._scratch = self.max_context + TREE_SLOTS
        pad = max(GRAPH_SIZES) if graphs != "off" else 0
        shape = (1, cfg.num_kv_heads, self._scratch + pad, cfg.head_dim)
        self._cache = [(torch.zeros(shape, dtype=self.dtype, device=weight.device),
                        torch.zeros(shape, dtype=self.dtype, device=weight.device))
                       for _ in range(cfg.num_layers)]
        self._inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, weight.device)
        self._slot_ids = torch.arange(shape[2], device=weight.device)
        self._fixed: dict[tuple[int, int, bool], _FixedPass] = {}  # by (size, span, features)
        self._pool: Any = None  # the captured graphs' shared memory pool
        self._len = 0
        self._ids = _CachedIds()  # the cached tokens (prefix reuse)
        self._features = False  # `record_features`

    def record_features(self, on: bool) -> None:
        """Return every fed row's final-normed state beside the logits (`features`), a
        prompt's rows too: the pass computes them anyway (a graph's output then carries
        them beside the logits)."""
        self._features = bool(on)

    @property
    def cache_len(self) -> int:
        return self._len

    def reset(self) -> None:
        self._len = 0
        self._ids.cut(0)

    def sequences(self, n: int) -> list[ModelBackend]:
        """`n` sequences in one batched cache over these weights (backends/torch/static_batch.py):
        requests decoded together share each call of the model."""
        from adaspec.backends.sequences import views
        from adaspec.backends.torch.static_batch import StaticSequences

        return list(views(StaticSequences(self, n + 1), n))

    def truncate(self, length: int) -> None:
        self._len = min(self._len, max(0, int(length)))
        self._ids.cut(self._len)

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
            ids = list(self._ids.read())
            self._ids.cut(0)
            if len(ids) >= self._len:
                self._ids.add(torch.tensor([ids[i] for i in at.tolist()]))
        else:
            self._ids.cut(n)
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
        kept = reusable_prefix(self._ids.read(), ids, reuse)
        self.truncate(kept)
        out = self._run(torch.tensor(ids[kept:]), None, None, hidden_layer,
                        last_row_only=True)
        out.cached = kept
        return out

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
        hidden = feats = None
        band_start = None  # where a fixed pass's mask may start hiding cached slots
        if (self.graphs != "off" and not last_row_only and hidden_layer is None
                and n <= GRAPH_SIZES[-1]):
            band_start = start if tree_mask is None else _first_hidden(tree_mask, start, n)
            if band_start is not None and start - band_start > BAND:
                band_start = None
        if band_start is not None:
            logits, feats = self._fixed_run(ids, pos, tree_mask, band_start)
        else:
            logits, hidden, feats = self._exact_run(ids, pos, tree_mask, hidden_layer,
                                                    last_row_only)
        self._len += n
        self._ids.cut(start)
        self._ids.add(ids)  # ids fed from the device stay there (a draft chain's own)
        # logits stay on the device: a step reads back ids and a few numbers only
        return ForwardOutput(logits=logits, hidden=hidden.cpu() if hidden is not None else None,
                             features=feats.float().cpu() if feats is not None else None)

    def _exact_run(self, ids: torch.Tensor, pos: torch.Tensor, tree_mask: torch.Tensor | None,
                   hidden_layer: int | None, last_row_only: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """A pass at the fed tokens' own shapes (prompts, hidden states, long passes): the
        logits, the asked layer's states, the final-normed states while recorded."""
        cfg, stack, dev = self.config, self.model.model, self._cache[0][0].device
        n, start = int(ids.numel()), self._len
        mask = self._mask(n, tree_mask).to(dev)
        cos, sin = rope(pos.to(dev), cfg.head_dim, cfg.rope_theta, self.dtype, self._inv_freq)
        x = stack.embed_tokens(ids.to(dev))[None]
        hidden = x[0] if hidden_layer == 0 else None
        layer: Any
        for i, layer in enumerate(stack.layers):
            x = layer.step(x, cos, sin, self._cache[i], start, mask)
            if hidden_layer is not None and i + 1 == hidden_layer < self.num_layers:
                hidden = x[0]
        x = stack.norm(x)
        if hidden_layer == self.num_layers:
            hidden = x[0]
        rows = x[0, -1:] if last_row_only else x[0]
        return self.model.lm_head(rows), hidden, x[0] if self._features else None

    def _fixed_run(self, ids: torch.Tensor, pos: torch.Tensor, tree_mask: torch.Tensor | None,
                   band_start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pass padded to the next of `GRAPH_SIZES`, attending over the first `span`
        slots: its inputs copied into the (size, span)'s buffers (two host-to-device copies),
        then its graph replayed (or, eagerly, the fixed-shape pass run); the real rows'
        logits [n, V] (and final-normed states [n, hidden] while recorded). Cached slots from
        `band_start` on are seen as `tree_mask` says, those before it by every row."""
        n, start = int(ids.numel()), self._len
        size = next(b for b in GRAPH_SIZES if b >= n)
        span = MIN_SPAN
        while span < start + size:
            span *= 2
        span = min(span, self._slot_ids.numel())
        key = (size, span, self._features)
        f = self._fixed.get(key)
        if f is None:
            f = self._fixed[key] = _FixedPass(
                size, torch.arange(span, device=self._slot_ids.device), self._scratch,
                self._features)
            if self.compiled:
                torch._dynamo.mark_dynamic(f.at, 0)
            if self.graphs == "cuda":
                self._capture(f)
        if tree_mask is None:  # a chain: made once per size and length (the host's time
            # is the step's time on a GPU)
            sees = _causal_sees(size, n)
        else:
            sees = _causal_sees(size, 0).clone()
            mask = tree_mask.to("cpu", torch.bool)
            if band_start < start:  # a mask as wide as the cache: its band's columns
                sees[:n, :start - band_start] = mask[:, band_start:start]
            sees[:n, BAND:BAND + n] = mask[:, -n:]
        f.load(ids, pos, torch.arange(start, start + n), sees, band_start)
        if f.graph is not None:
            f.graph.replay()
            out = f.out[:n].clone()  # the graph's output buffer is overwritten next replay
        else:
            out = self._run_pass(f)[:n]
        if not f.features:
            return out, None
        return out[:, :self.vocab_size], out[:, self.vocab_size:]

    def _run_pass(self, f: _FixedPass) -> torch.Tensor:
        """The fixed pass, compiled where asked; a compiler that fails here (no C++ compiler,
        a Triton without this GPU) leaves the eager pass, said once on stderr."""
        try:
            return self._pass(f)
        except Exception as exc:
            if not self.compiled:
                raise
            print(f"adaspec: torch.compile failed for the static runtime "
                  f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); running it "
                  "uncompiled", file=sys.stderr, flush=True)
            self.compiled, self._pass = False, self._fixed_pass
            return self._pass(f)

    def _fixed_pass(self, f: _FixedPass) -> torch.Tensor:
        """Logits [size, V] of a fixed pass, the final-normed states after them [size, V +
        hidden] where `f.features`: every shape depends on the size and span alone, and the
        cache length, slots and mask are read from tensors (what a captured graph
        replays)."""
        cfg, stack = self.config, self.model.model
        size = f.ids.shape[0]
        rel = f.at - f.band_start  # [span]: slot index within the band
        band = f.sees[:, rel.clamp(0, BAND - 1)]  # [size, span]
        mask = torch.where((rel >= 0) & (rel < BAND), band, rel < 0)
        new = f.at - f.slots[0]  # [span]: the new token a slot holds (padding's: none)
        mask = torch.where((new >= 0) & (new < size), f.sees[:, BAND + new.clamp(0, size - 1)],
                           mask)
        # a row that sees nothing (padding before any real pass) sees slot 0: a bare row's
        # attention is NaN, and a NaN value written to the cache poisons every later read
        mask = mask | ((f.at == 0) & ~mask.any(-1, keepdim=True))
        cos, sin = rope(f.positions, cfg.head_dim, cfg.rope_theta, self.dtype, self._inv_freq)
        x = stack.embed_tokens(f.ids)[None]
        layer: Any
        for i, layer in enumerate(stack.layers):
            x = layer.step(x, cos, sin, self._cache[i], 0, mask, slots=f.slots[None])
        normed = stack.norm(x)[0]
        logits = self.model.lm_head(normed)
        return torch.cat([logits, normed], -1) if f.features else logits

    def _capture(self, f: _FixedPass) -> None:
        """Record `f`'s pass as a CUDA graph; its buffers hold padding only, so neither the
        warm-up nor the capture writes a real cache slot."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        self._run_pass(f)  # compiles (or falls back) outside the capture
        f.graph, f.out = capture_graph(lambda: self._pass(f), self._pool)


class _CachedIds:
    """The cached tokens' ids, which only a prompt's prefix reuse reads: a host list, then
    the ids fed from the device and not read yet (a draft chain's own tokens, fed back
    without a read). Cutting never reads; `read` does, once, when a prompt asks."""

    def __init__(self) -> None:
        self.known: list[int] = []
        self.unread: list[torch.Tensor] = []  # [n] each, after `known`

    def add(self, ids: torch.Tensor) -> None:
        if ids.device.type == "cpu" and not self.unread:
            self.known.extend(ids.tolist())
        else:
            self.unread.append(ids)

    def cut(self, length: int) -> None:
        """Keep the first `length` ids."""
        if length <= len(self.known):
            del self.known[length:]
            self.unread = []
            return
        left, kept = length - len(self.known), []
        for ids in self.unread:
            if left <= 0:
                break
            kept.append(ids[:left])
            left -= int(ids.numel())
        self.unread = kept

    def read(self) -> list[int]:
        if self.unread:
            device = self.unread[0].device
            self.known.extend(torch.cat([t.to(device) for t in self.unread]).tolist())
            self.unread = []
        return self.known


class _FixedPass:
    """The device buffers of one fixed pass (size, span): token ids, rotary positions and
    cache slots [size] (padding: token 0 at position 0, in scratch slots), the first cached
    slot the mask may hide (`band_start`: every row sees the slots before it), and what each
    row sees [size, BAND + size] of the BAND slots from there and of the new tokens; a
    captured graph reads them at each replay. `at` [span] numbers the slots attended to;
    `features`: the pass returns the final-normed states beside the logits."""

    def __init__(self, size: int, at: torch.Tensor, scratch: int,
                 features: bool = False) -> None:
        self.size = size
        self.at = at
        self.features = features
        device = at.device
        self._scratch = torch.arange(scratch, scratch + size)
        self.inputs = PassInputs({"ids": (size,), "positions": (size,), "slots": (size,),
                                  "band_start": ()}, device)
        dev = self.inputs.dev
        self.ids, self.positions, self.slots, self.band_start = (
            dev["ids"], dev["positions"], dev["slots"], dev["band_start"])
        self.sees = torch.zeros(size, BAND + size, dtype=torch.bool, device=device)
        self.graph: Any = None
        self.out: Any = None
        empty = torch.zeros(0, dtype=torch.long)
        self.load(empty, empty, empty, _causal_sees(size, 0), 0)

    def load(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             sees: torch.Tensor, band_start: int) -> None:
        n, host = int(ids.numel()), self.inputs.host
        self.inputs.clear()
        on_host = ids.device.type == "cpu"
        if on_host:
            host["ids"][:n] = ids
        host["positions"][:n] = positions
        host["slots"][:n] = slots
        host["slots"][n:] = self._scratch[: self.size - n]
        host["band_start"].fill_(band_start)
        self.inputs.send()
        if not on_host:  # ids fed from the device (a drafted token): copied there, not read
            self.ids[:n].copy_(ids)
        self.sees.copy_(sees)


@functools.cache
def _causal_sees(size: int, n: int) -> torch.Tensor:
    """What each row of a fixed pass of `size` sees [size, BAND + size] when its first `n`
    rows are a chain: the band nothing, the chain causally, the padding itself only."""
    sees = torch.zeros(size, BAND + size, dtype=torch.bool)
    sees[:, BAND:] = torch.eye(size, dtype=torch.bool)
    sees[:n, BAND:BAND + n] = torch.ones(n, n, dtype=torch.bool).tril()
    return sees


def _first_hidden(tree_mask: torch.Tensor, start: int, n: int) -> int | None:
    """The first cached slot a pass's mask hides from some new token: `start` where it hides
    none or spans the new tokens only [n, n]; None where the mask has another width. A draft
    tree's level [n, start + n] hides the earlier levels' other branches."""
    width = tree_mask.shape[-1]
    if width == n:
        return start
    if width != start + n:
        return None
    hidden = (~tree_mask[:, :start].to("cpu", torch.bool)).any(0).nonzero()
    return int(hidden[0]) if hidden.numel() else start


def static_backend(hf_model: nn.Module, name: str, device: str = "cpu",
                   max_context: int = DEFAULT_CONTEXT, graphs: str = "auto",
                   compile: bool = False) -> StaticTorchBackend:
    """A transformers causal LM's weights in the static runtime on `device`."""
    model = DecoderLM.from_hf(hf_model).to(device)
    limit = int(getattr(hf_model.config, "max_position_embeddings", max_context))
    return StaticTorchBackend(model, name, min(max_context, limit), graphs, compile)
