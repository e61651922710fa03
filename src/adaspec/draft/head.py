"""The draft head's drafter: chains from a small module over the target's own features.

The head (`draft/head_model.py`) keeps a cache of its inputs at the accepted positions, each
built from the target's feature there (the final-normed state the verification pass
returned, `RequestState.features`) and the embedding of the token after it. A step first
feeds the positions accepted since the last one (in one call: the path the target accepted
and its own token), whose last output gives the first draft token; each further draft token
feeds the head's own output back as the feature. Drafted positions never enter the cache:
once verified, they come back with the target's features, so nothing is rolled back but a
cut to the common prefix when the context changes.

Where the runtime returned no feature for a position (a prompt scored for its last row only)
the head's cache simply lacks it: the positions stay absolute (rotary positions), and the
head drafts from what it has. Probabilities come over the full vocabulary with q = 0 outside
the kept tokens (`TokenHead.full_logits`), so speculative sampling stays exact.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from adaspec.control.base import LengthController
from adaspec.core.proposal import Proposal
from adaspec.core.request import RequestState
from adaspec.core.sampling import SamplingParams, argmax, draw
from adaspec.draft.base import Drafter
from adaspec.draft.head_model import DraftHead, TokenHead
from adaspec.errors import InputError

# a head's weights at run time: fp32 | bf16 | int8 (int8 rows, bf16 activations) | int8-dyn |
# ggml (its layer and output head in ik_llama.cpp, Q8_0: `draft/head_ggml.py`); a method's
# `default` is ggml where the target runs in ik_llama.cpp, int8 elsewhere (`head_ggml`)
WEIGHTS = ("fp32", "bf16", "int8", "int8-dyn", "ggml")


# A server builds an engine for every request: the engines of one head share one copy of
# it (and of the target's embeddings, 466 MB in bf16, read from a runtime target's file; a
# torch target's are its own tensors, so those copies go with its model) and one timing
_Parts = tuple[DraftHead, TokenHead, torch.Tensor]
_SHARED: dict[tuple, _Parts] = {}
_SHARED_WITH_MODEL: weakref.WeakKeyDictionary[nn.Module, dict[tuple, _Parts]] = \
    weakref.WeakKeyDictionary()
_STEP_MS: weakref.WeakKeyDictionary[DraftHead, float] = weakref.WeakKeyDictionary()
# online learning publishes from its own thread (`replace_head`) while engines load
_LOCK = threading.RLock()


def weights_dtype(weights: str) -> torch.dtype:
    """The float dtype a head runs in with `weights` (int8: bf16 activations)."""
    return torch.bfloat16 if weights in ("bf16", "int8", "ggml") else torch.float32


def _load_parts(path, target, weights: str) -> tuple[DraftHead, TokenHead, torch.Tensor]:
    from adaspec.draft.head_artifact import load_for_target

    head, tokens, embed = load_for_target(path, target, weights_dtype(weights))
    return serving_head(head, weights), serving_tokens(tokens, weights), embed


def serving_tokens(tokens: TokenHead, weights: str) -> TokenHead:
    """The kept tokens' output rows as the drafter runs them (converted in place): in the
    head's float dtype, int8 rows for the int8 formats."""
    tokens = tokens.to(weights_dtype(weights)).eval()
    if weights.startswith("int8"):
        from adaspec.store.quant import quantize_model

        quantize_model(tokens, weights)
    return tokens


def serving_head(head: DraftHead, weights: str) -> DraftHead:
    """`head` as the drafter runs it, converted in place (give a copy to keep a float one).
    int8: weight-only rows (a quarter of fp32's bytes, which is what a head step waits on
    once the target's call has evicted it), bf16 activations; int8-dyn: int8 activations
    too (cheaper still, and it loses acceptance); ggml: torch runs only its fc (int8 rows),
    the rest runs in ik_llama.cpp (`draft/head_ggml.py`), from these bf16 weights."""
    head = head.to(weights_dtype(weights)).eval()
    if weights == "ggml":
        from adaspec.store.quant import quantize_model

        fc = nn.ModuleDict({"fc": head.fc})
        quantize_model(fc, "int8")
        head.fc = fc["fc"]  # type: ignore[assignment]
    elif weights.startswith("int8"):
        from adaspec.store.quant import quantize_model

        head.layer.quantize_fused(lambda fused: quantize_model(fused, weights))
        quantize_model(head, weights)
    return head


def replace_head(old: DraftHead, new: DraftHead, tokens: TokenHead | None = None) -> int:
    """Engines built from now on draft with `new` (and, given, the kept tokens `tokens`)
    wherever they drafted with `old` (what online learning publishes); engines already
    drafting finish their request with `old`. The number of shared copies replaced."""
    replaced = 0
    with _LOCK:
        for shared in (_SHARED, *_SHARED_WITH_MODEL.values()):
            for key, (head, kept, embed) in list(shared.items()):
                if head is old:
                    shared[key] = (new, tokens if tokens is not None else kept, embed)
                    replaced += 1
        if old in _STEP_MS:  # the same shapes and format: the same step time
            _STEP_MS[new] = _STEP_MS[old]
    return replaced


class HeadDrafter(Drafter):
    name = "head"
    needs_features = True
    fuses = True  # runs its layer in torch: q/k/v and gate/up as one product each

    def __init__(self, head: DraftHead, tokens: TokenHead, embed: torch.Tensor) -> None:
        """embed [V, H]: the target's token embeddings (read a row at a time)."""
        self.head = head.eval()
        if self.fuses:
            head.layer.fuse()
        self.tokens = tokens
        self.embed = embed
        self._dtype = next(head.parameters()).dtype
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fed = 0  # inputs 0 .. _fed - 1 are in the cache (those with a feature)
        self._positions = torch.empty(0, dtype=torch.long)  # of the inputs in the cache
        self._cached: list[int] = []  # the context the cache was built on
        # the artifact and run-time weights it was loaded from (`load`; online learning
        # starts from the artifact's float weights and publishes in these)
        self.origin: tuple[Path, str] | None = None

    @staticmethod
    def shared_parts(path, target, weights: str) -> tuple[Path, _Parts]:
        """The head's file and its parts in `weights`, loaded once per file version, format
        and target: each drafter keeps only its own request's cache (`_SHARED`)."""
        if weights not in WEIGHTS:
            raise InputError(f"weights must be one of {', '.join(WEIGHTS)}")
        file = Path(path).resolve()
        stat = file.stat()
        key = (str(file), stat.st_mtime_ns, stat.st_size, weights, target.name)
        model = getattr(target, "model", None)
        with _LOCK:
            shared = (_SHARED if not isinstance(model, nn.Module)
                      else _SHARED_WITH_MODEL.setdefault(model, {}))
            parts = shared.get(key)
            if parts is None:
                parts = shared[key] = _load_parts(file, target, weights)
        return file, parts

    @classmethod
    def load(cls, path, target, weights: str = "int8") -> HeadDrafter:
        """The drafter of a saved head (`draft/head_artifact.py`) over `target`'s own
        embeddings and output rows, its weights at run time in `weights` (`WEIGHTS`; ggml:
        `draft.head_ggml.load_drafter`)."""
        if weights == "ggml":
            raise InputError("weights=ggml: adaspec.draft.head_ggml.load_drafter")
        file, parts = cls.shared_parts(path, target, weights)
        drafter = cls(*parts)
        drafter.origin = (file, weights)
        return drafter

    def step_ms(self, context: int = 256, reps: int = 12) -> float:
        """The median ms of one draft step (a head forward over a cache of `context`
        positions, then the next token's logits) on this machine, now, cache-warm: `auto`'s
        first price of a head token (then learned from the steps it runs); measured once per
        process for the defaults."""
        import time

        default = (context, reps) == (256, 12)
        with _LOCK:
            known = _STEP_MS.get(self.head) if default else None
        if known is not None:
            return known

        step = self.probe_step(context)
        times = []
        for _ in range(reps + 3):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        times = sorted(times[3:])
        ms = 1000 * times[len(times) // 2]
        if default:
            with _LOCK:
                _STEP_MS[self.head] = ms
        return ms

    def probe_step(self, context: int) -> Callable[[], None]:
        """One draft step (a head forward over a zero cache of `context` positions, then the
        next token's logits), as a callable to time: what a token drafted costs."""
        cfg = self.head.cfg
        kv = (torch.zeros(1, cfg.kv_heads, context, cfg.head_dim, dtype=self._dtype),
              torch.zeros(1, cfg.kv_heads, context, cfg.head_dim, dtype=self._dtype))
        hidden = torch.zeros(1, 1, cfg.hidden, dtype=self._dtype)

        def step() -> None:
            chain = HeadChain(self, hidden, kv, context)
            chain.advance(0)
            chain.draw(SamplingParams(0.0), None)

        return step

    def use(self, head: DraftHead, tokens: TokenHead) -> None:
        """Draft with `head` over the kept tokens `tokens` from the next request on (online
        learning's head of a request's domain, `online/head_service.py`)."""
        if head is self.head and tokens is self.tokens:
            return
        self.head, self.tokens = head.eval(), tokens
        if self.fuses:
            head.layer.fuse()
        self._dtype = next(head.parameters()).dtype
        self._kv, self._fed, self._cached = None, 0, []

    def begin(self, req: RequestState) -> None:
        self._kv, self._fed, self._cached = None, 0, []
        self._positions = torch.empty(0, dtype=torch.long)

    def _embeds(self, ids: list[int]) -> torch.Tensor:
        return self.embed[torch.tensor(ids)].to(self._dtype)[None]  # [1, n, H]

    def _sync(self, context: list[int]) -> None:
        """Keep the cache's inputs the context still agrees with (a cut to the common
        prefix: input i reads tokens i and i + 1)."""
        n = 0
        limit = min(len(self._cached), len(context))
        while n < limit and self._cached[n] == context[n]:
            n += 1
        keep = max(0, min(self._fed, n - 1))
        if keep < self._fed and self._kv is not None:
            k, v = self._kv
            kept = int((self._positions < keep).sum())
            self._kv = (k[:, :, :kept], v[:, :, :kept]) if kept else None
            self._positions = self._positions[:kept]
        self._fed = keep
        self._cached = list(context)

    def _catch_up(self, req: RequestState) -> torch.Tensor | None:
        """Feed the inputs of the positions accepted since the last step; the newest one's
        output [1, 1, H], or None when the target gave no feature of the newest position."""
        context = req.context
        self._sync(context)
        newest = len(context) - 2  # input i: (feature at i, token i + 1)
        first, feats = req.features_of(self._fed, newest + 1)
        if feats is None or first + len(feats) - 1 != newest:
            return None
        out = self._feed(feats, context[first + 1 : newest + 2], list(range(first, newest + 1)))
        if out is not None:
            self._fed = newest + 1
        return out

    def _feed(self, feats: torch.Tensor, ids: list[int], positions: list[int]
              ) -> torch.Tensor | None:
        """Run the head over inputs (features [T, H], the tokens after them) at `positions`
        into its cache; the last one's output [1, 1, H] (None: not fed)."""
        at = torch.tensor(positions)
        with torch.no_grad():
            out, self._kv = self.head(feats.to(self._dtype)[None], self._embeds(ids),
                                      at[None], self._kv)
        self._positions = torch.cat([self._positions, at])
        return out[:, -1:]

    def _chain(self, hidden: torch.Tensor, position: int) -> HeadChain:
        return HeadChain(self, hidden, self._kv, position)

    def open(self, req: RequestState) -> HeadChain | None:
        """A chain from the request's newest accepted position (None: the target gave no
        feature of it, so the head cannot draft this step)."""
        hidden = self._catch_up(req)
        if hidden is None:
            return None
        return self._chain(hidden, len(req.context) - 1)

    def propose(self, req: RequestState, max_tokens: int,
                controller: LengthController) -> Proposal:
        context = req.context
        chain = self.open(req) if max_tokens > 0 else None
        if chain is None:
            return Proposal.chain(context[-1], [])
        tokens: list[int] = []
        accept: list[float] = []
        rows: list[torch.Tensor] = []
        for i in range(max_tokens):
            drawn, probs, small = chain.draw(req.sampling, req.generator)
            if probs is not None:
                rows.append(probs)
            # the controller's numbers (confidence, entropy) are the same over the kept
            # tokens as over the full vocabulary, where the rest is -inf; the top
            # probability is the token's acceptance estimate (the head is calibrated:
            # experiments/results/head-calibration-xeon-amx)
            read = torch.cat([drawn.double(), torch.softmax(small, -1).max().double()[None],
                              controller.draft_numbers(small).double()]).tolist()
            tokens.append(int(read[0]))
            accept.append(read[1])
            if i + 1 == max_tokens or not controller.decide(i, read[2:]):
                break
            chain.advance(tokens[-1])
        return Proposal.chain(context[-1], tokens, torch.stack(rows) if rows else None,
                              head_calls=len(tokens), accept=accept)

    def commit(self, req: RequestState, path: list[int]) -> None:
        self._sync(req.context)


class HeadChain:
    """The head drafting forward from one accepted position: `logits` of the next token over
    the full vocabulary (q = 0 outside the kept tokens), `advance` feeds a drafted token back
    (its own output standing in for the target's feature). Drafted positions live in this
    chain's cache only, never in the drafter's."""

    def __init__(self, drafter: HeadDrafter, hidden: torch.Tensor,
                 kv: tuple[torch.Tensor, torch.Tensor] | None, position: int) -> None:
        self._drafter = drafter
        self._hidden = hidden  # [1, 1, H]: the head's output at the newest position
        self._kv = kv
        self._position = position  # of the next input the chain feeds
        self.steps = 1  # head forwards this chain ran (the catch-up counts as one)

    @property
    def token_ids(self) -> torch.Tensor:
        """[N] the kept tokens' ids, in the order of `small_logits`."""
        return self._drafter.tokens.token_ids

    def small_logits(self) -> torch.Tensor:
        """[N] float logits of the next token over the kept tokens (`TokenHead.token_ids`)."""
        with torch.no_grad():
            return self._drafter.tokens(self._hidden)[0, -1].float()

    def logits(self) -> torch.Tensor:
        """[V] float logits of the next token, -inf outside the kept set."""
        return self._drafter.tokens.full_logits(self.small_logits())

    def draw(self, params: SamplingParams, generator: torch.Generator | None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The next drafted token [1], its processed distribution over the full vocabulary
        [V] (None when greedy: the argmax over the kept tokens, no full row built) and the
        kept tokens' logits [N]."""
        small = self.small_logits()
        if params.greedy:
            return self._drafter.tokens.token_ids[argmax(small)].reshape(1), None, small
        drawn, probs = draw(self._drafter.tokens.full_logits(small), params, generator)
        return drawn, probs, small

    def advance(self, token: int) -> None:
        d = self._drafter
        with torch.no_grad():
            self._hidden, self._kv = d.head(self._hidden, d._embeds([token]),
                                            torch.tensor([[self._position]]), self._kv)
        self._position += 1
        self.steps += 1
