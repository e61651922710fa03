"""The model backend interface: all the decode loop knows about a model.

A backend owns one KV cache. Tokens are fed with explicit positions; an optional tree mask
lets a flattened token tree be scored in one pass (each node sees the cached prefix and its
own ancestors). `truncate` rolls the cache back, `keep` compacts it to an accepted tree path.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from adaspec.errors import InputError

BATCH_NOISE_ENV = "ADASPEC_BATCH_NOISE"  # overrides a runtime's batch noise (0: no rechecks)


def batch_noise_setting(measured: float) -> float:
    """A runtime's batch noise: its measured value, or the ADASPEC_BATCH_NOISE override (for
    measuring what the near-tie recheck buys, e.g. 0 to turn it off)."""
    text = os.environ.get(BATCH_NOISE_ENV, "").strip()
    if not text:
        return measured
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"{BATCH_NOISE_ENV} must be a number of logits, got {text!r}") from None
    if not value >= 0:
        raise InputError(f"{BATCH_NOISE_ENV} must be >= 0, got {text!r}")
    return value


class ForwardOutput:
    """What a pass scored. `device_logits` stay where the model ran (a GPU's memory), so a
    greedy step reads back only its argmax ids (one host transfer per step); `logits` is
    their host copy, made once, when a reader first asks for it."""

    __slots__ = ("device_logits", "hidden", "cached", "features", "_host")

    def __init__(self, logits: torch.Tensor, hidden: torch.Tensor | None = None,
                 cached: int = 0, features: torch.Tensor | None = None) -> None:
        self.device_logits = logits  # [n, vocab] float, one row per fed token
        self.hidden = hidden  # [n, hidden] at the requested layer (on the CPU), if asked
        self.cached = cached  # a prefill: leading prompt tokens the cache held, not scored
        # [n, hidden] the final-normed states of the scored rows, from the same pass (a
        # draft head's input), where the runtime records them (`record_features`)
        self.features = features
        self._host: torch.Tensor | None = logits if logits.device.type == "cpu" else None

    @property
    def logits(self) -> torch.Tensor:
        """[n, vocab] float on the CPU."""
        if self._host is None:
            self._host = self.device_logits.cpu()
        return self._host


class ModelBackend(ABC):
    """One model plus its KV cache."""

    name: str
    vocab_size: int
    max_context: int
    num_layers: int
    hidden_size: int
    bytes_per_forward: int  # weight bytes read by one forward pass (for bandwidth figures)
    kind: str = "torch"  # the runtime (a cost profile is keyed by it): torch | llamacpp | ik_llama
    device: str = "cpu"  # where the weights are: cpu | cuda (torch runtimes on a GPU)
    # The largest change of a token's top-2 logit gap measured between its single-token pass
    # and a multi-token pass (experiments/batch_noise.py). Greedy verification re-scores alone
    # every row of a multi-token pass whose gap is not above it, so speculation emits what
    # plain decoding emits; 0: a block scores what single passes score (row-invariant).
    batch_noise: float = 0.0
    supports_trees: bool = True  # tree masks and `keep` of any path, not only chains
    has_hidden_states: bool = True  # `hidden_layer` (the router reads the prompt's state)
    # `record_features`: its passes return the scored rows' final-normed states beside the
    # logits (`ForwardOutput.features`, a draft head's input)
    has_features: bool = False
    # a tree pass's nodes lie in one block of this many cache cells, its root's (0: any
    # tree); `tree_span`: the cells a sequence's cache holds (`tree_room`)
    tree_block: int = 0
    tree_span: int = 0

    def tree_room(self, root: int) -> int | None:
        """The most tokens (root included) one tree pass may hold with its root at cache
        position `root`: None where any tree fits, 1 where the runtime scores chains only."""
        if not self.supports_trees:
            return 1
        if not self.tree_block:
            return None
        return max(1, min(self.tree_block - root % self.tree_block, self.tree_span - root))

    def record_features(self, on: bool) -> None:
        """Return the scored rows' final-normed states beside their logits from now on."""
        if on:
            raise InputError(f"the {self.kind} runtime gives no target features")

    @property
    @abstractmethod
    def cache_len(self) -> int:
        """Number of tokens whose keys/values are cached."""

    @abstractmethod
    def reset(self) -> None:
        """Drop the KV cache (a new request)."""

    @abstractmethod
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        hidden_layer: int | None = None,
    ) -> ForwardOutput:
        """Score `tokens` [n] after the cache and append them to it.

        positions: [n] absolute positions (default: cache_len, cache_len + 1, ...).
        tree_mask: [n, n] bool, True where new token i may attend to new token j
            (default: causal). The cached prefix is always visible. Or [n, cache_len + n]
            to choose the visible cached tokens too (a draft expanding a tree level by level
            keeps earlier levels in its cache, and a node must see only its own ancestors).
        hidden_layer: also return the hidden state after this many decoder layers
            (num_layers = the final normed state that feeds the output head).
        """

    def prefill(
        self, tokens: torch.Tensor, hidden_layer: int | None = None, reuse: int = 0
    ) -> ForwardOutput:
        """Reset and score a whole prompt. Callers read the last row of the logits only (the
        next token's distribution); a backend may skip the output head for the other rows,
        which for a long prompt is a large share of the work (llama.cpp does).

        reuse: the caller's previous prompt shared this many leading tokens with this one; a
        backend that knows what its cache holds may keep up to that many of them instead of
        scoring them again (a server's chat template repeats its system turn). This one
        scores everything."""
        self.reset()
        return self.forward(tokens, hidden_layer=hidden_layer)

    def synchronize(self) -> None:
        """Wait until the device finished what was queued (a GPU runs passes asynchronously;
        a CPU runtime has returned already): a timer stopped after this times the pass."""
        if self.device == "cuda":
            torch.cuda.synchronize()

    @abstractmethod
    def truncate(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""

    @abstractmethod
    def keep(self, indices: torch.Tensor) -> None:
        """Keep only the cached tokens at `indices` (ascending), e.g. an accepted tree path."""


def reusable_prefix(held: list[int], ids: list[int], reuse: int) -> int:
    """How many leading tokens of prompt `ids` a cache holding `held` may keep: what both
    share, up to `reuse`, with at least the last prompt token left to score."""
    return min(max(0, int(reuse)), len(ids) - 1, common_prefix(held, ids))


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def tree_parents(tree_mask: torch.Tensor) -> list[int]:
    """Each node's parent (-1 for node 0, the root) from a tree pass's mask [n, n] (True
    where node i sees node j: its ancestors and itself); InputError where it is no tree."""
    mask = tree_mask.to(torch.bool)
    n = int(mask.shape[0])
    if mask.dim() != 2 or mask.shape[1] != n or n == 0:
        raise InputError(f"a tree mask is [n, n], got {list(mask.shape)}")
    parents = [-1]
    for i in range(1, n):
        seen = mask[i, :i].nonzero().reshape(-1)
        if not len(seen):
            raise InputError(f"tree node {i} sees no earlier node (the root is node 0)")
        par = int(seen[-1])
        want = mask[par].clone()
        want[i] = True
        if not torch.equal(mask[i], want):
            raise InputError(f"tree node {i} does not see exactly its ancestors and itself")
        parents.append(par)
    if not bool(mask[0, 0]) or bool(mask[0, 1:].any()):
        raise InputError("the tree's root (node 0) sees itself only")
    return parents


def chain_ids(
    what: str,
    cache_len: int,
    tokens: torch.Tensor,
    positions: torch.Tensor | None,
    tree_mask: torch.Tensor | None,
    hidden_layer: int | None,
) -> list[int]:
    """The token ids of a `forward` call on a chains-only backend (`what`, e.g. "the
    llama.cpp backend"): no tree mask, no hidden state, positions right after the cache."""
    if tree_mask is not None or hidden_layer is not None:
        raise InputError(f"{what} scores chains only (no token trees, no hidden states)")
    ids = [int(t) for t in tokens.reshape(-1)]
    if positions is not None and positions.reshape(-1).tolist() != list(
        range(cache_len, cache_len + len(ids))
    ):
        raise InputError(f"{what} feeds tokens right after its cache")
    return ids


class ChainBackend(ModelBackend):
    """A llama.cpp-like runtime (llama.cpp and its forks): tokens after the cache, logits for
    every fed token, a prompt prefill with the last row's logits only, and a KV cache that
    rolls back by position. Subclasses give `_feed` and `_remove_from`; one that scores token
    trees (`supports_trees`) also `_feed_tree` and `_keep_tree`."""

    supports_trees = False  # a runtime of trees gives `_feed_tree` and `_keep_tree`
    has_hidden_states = False
    runtime = "this runtime"  # for error messages, e.g. "llama.cpp"
    _len = 0
    # the tree scored last, until the verdict keeps its path: (root position, parents)
    _tree: tuple[int, list[int]] | None = None

    @property
    def cache_len(self) -> int:
        return self._len

    def reset(self) -> None:
        self.truncate(0)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        hidden_layer: int | None = None,
    ) -> ForwardOutput:
        if tree_mask is not None and self.supports_trees and hidden_layer is None:
            parents = tree_parents(tree_mask)
            if parents != list(range(-1, len(parents) - 1)):  # else a chain
                at = None if positions is None else positions.reshape(-1).tolist()
                return self.forward_tree([int(t) for t in tokens.reshape(-1)], at, parents)
            tree_mask = None
        ids = chain_ids(f"the {self.runtime} backend", self._len, tokens, positions, tree_mask,
                        hidden_layer)
        logits = self._checked_feed(ids, every_row=True)
        return ForwardOutput(logits=logits, features=self._fed_features())

    def forward_tree(self, ids: list[int], positions: list[int] | None,
                     parents: list[int]) -> ForwardOutput:
        """A token tree (node 0 the root, fed right after the cache; parents[i] < i) in one
        call, its nodes cached until `keep` or `truncate` keeps the accepted path where a
        chain puts it. `forward` with the tree's mask comes here."""
        if len(parents) != len(ids):
            raise InputError(f"a tree of {len(ids)} tokens needs a mask of as many rows")
        depths = [0] * len(ids)
        for i in range(1, len(ids)):
            depths[i] = depths[parents[i]] + 1
        at = [self._len + d for d in depths]
        if positions is not None and list(positions) != at:
            raise InputError("a tree's nodes sit at their root's position plus their depth, "
                             "the root right after the cache")
        room = self.tree_room(self._len) or len(ids)
        if len(ids) > room:
            raise InputError(f"this {self.runtime} context scores a tree of at most {room} "
                             f"tokens at position {self._len}, not {len(ids)}")
        if self._len + len(ids) > self.max_context:
            raise InputError(f"context too long for {self.runtime}: "
                             f"{self._len + len(ids)} > {self.max_context} tokens")
        cached = self._token_ids()
        del cached[self._len :]
        try:
            logits = self._feed_tree(ids, at, parents)
        except BaseException:
            del cached[:]
            raise
        self._tree = (self._len, parents)
        cached.extend(ids)
        self._len += len(ids)
        return ForwardOutput(logits=logits, features=self._fed_features())

    def _feed_tree(self, ids: list[int], positions: list[int], parents: list[int]
                   ) -> torch.Tensor:
        """Score the tree (ids[0] its root at positions[0] = the cache length; parents[i]
        < i) in one call, its nodes cached; their logits [n, V]."""
        raise InputError(f"the {self.runtime} backend scores chains only (no token trees)")

    def _keep_tree(self, root: int, n: int, path: list[int]) -> None:
        """After `_feed_tree` (root at position `root`, n tokens): keep nodes `path`, one a
        depth, in the cache where a chain puts them; free the others."""
        raise InputError(f"the {self.runtime} backend scores chains only (no token trees)")

    def _keep_path(self, path: list[int]) -> None:
        """Keep tree nodes `path` (one per depth from 1, each the previous one's child)."""
        assert self._tree is not None
        root, parents = self._tree
        self._tree = None
        if any(not 0 < node < len(parents) or parents[node] != (path[d - 1] if d else 0)
               for d, node in enumerate(path)):
            self.truncate(root + 1)
            raise InputError(f"tree nodes {path} are no path below the root")
        ids = self._token_ids()
        nodes = ids[root : root + len(parents)]
        del ids[root + 1 :]
        try:
            self._keep_tree(root, len(parents), path)
        except BaseException:
            self._len = root + 1
            raise
        ids.extend(nodes[i] for i in path)
        self._len = root + 1 + len(path)

    def _fed_features(self) -> torch.Tensor | None:
        """The last feed's rows' final-normed states, where the runtime records them."""
        return None

    def prefill(
        self, tokens: torch.Tensor, hidden_layer: int | None = None, reuse: int = 0
    ) -> ForwardOutput:
        """Score a prompt with logits for its last token only: the output head over every
        prompt row (151,936 columns for Qwen) would cost more than the prompt itself. Up to
        `reuse` leading tokens the cache already holds at the same positions are kept (at
        least the last prompt token is scored, for its logits). hidden_layer: where the
        runtime gives it (`has_hidden_states`), the final layer's state of the last prompt
        token [1, hidden] (the router's input)."""
        if hidden_layer is not None and not self.has_hidden_states:
            raise InputError(f"the {self.runtime} backend has no hidden states")
        if hidden_layer is not None and hidden_layer != self.num_layers:
            raise InputError(f"the {self.runtime} backend gives the final layer's state only "
                             f"(layer {self.num_layers}), not layer {hidden_layer}")
        ids = [int(t) for t in tokens.reshape(-1)]
        if not ids:
            raise InputError("empty prompt")
        kept = self._keep_prefix(ids, reuse)
        logits = self._checked_feed(ids[kept:], every_row=False)
        features = self._fed_features()  # before a second pass for the router's state
        hidden = self._final_state() if hidden_layer is not None else None
        return ForwardOutput(logits=logits, hidden=hidden, cached=kept, features=features)

    def _keep_prefix(self, ids: list[int], reuse: int) -> int:
        """Keep what the cache holds of prompt `ids` (up to `reuse` tokens, at least one
        left to score); how many tokens are kept."""
        kept = reusable_prefix(self._token_ids(), ids, reuse)
        self.truncate(kept)
        return kept

    def _final_state(self) -> torch.Tensor:
        """The last cached token's final-layer state [1, hidden], its cache entry as it
        was (runtimes with `has_hidden_states` give it)."""
        raise InputError(f"the {self.runtime} backend has no hidden states")

    def _token_ids(self) -> list[int]:
        """The tokens whose keys and values the cache holds, in order."""
        return self.__dict__.setdefault("_cached_ids", [])

    def held(self) -> list[int]:
        """The tokens the cache holds, in order (a copy: what a prompt could keep)."""
        return self._token_ids()[: self._len]

    def _checked_feed(self, ids: list[int], every_row: bool) -> torch.Tensor:
        if self._len + len(ids) > self.max_context:
            raise InputError(
                f"context too long for {self.runtime}: {self._len + len(ids)} > "
                f"{self.max_context} tokens"
            )
        cached = self._token_ids()
        del cached[self._len :]
        try:
            out = self._feed(ids, every_row)
        except BaseException:
            del cached[:]  # what the runtime kept of a failed call is unknown: reuse nothing
            raise
        cached.extend(ids)
        return out

    @abstractmethod
    def _feed(self, ids: list[int], every_row: bool) -> torch.Tensor:
        """Decode `ids` after the cache (advancing `_len`); the logits of every fed token
        [n, vocab], or of the last one only [1, vocab]."""

    @abstractmethod
    def _remove_from(self, length: int) -> None:
        """Drop the cached positions from `length` on."""

    def truncate(self, length: int) -> None:
        if self._tree is not None:
            root, parents = self._tree
            if length > root + 1:  # the tree's first nodes, a chain below its root
                self._keep_path(list(range(1, min(length - root, len(parents)))))
            else:
                self._tree = None  # the cut frees every node
        if length < self._len:
            self._remove_from(length)
            self._len = length
            del self._token_ids()[length:]

    def keep(self, indices: torch.Tensor) -> None:
        """A prefix of the cache; after a tree, the context and one path below its root."""
        kept = [int(i) for i in indices.reshape(-1)]
        if self._tree is not None:
            root = self._tree[0]
            if kept[: root + 1] != list(range(root + 1)):
                raise InputError("after a tree the cache keeps its context and a path below "
                                 "the root")
            self._keep_path([i - root for i in kept[root + 1 :]])
            return
        if kept != list(range(len(kept))):
            raise InputError(f"the {self.runtime} backend keeps cache prefixes only "
                             "(no token trees)")
        self.truncate(len(kept))


# ---------------------------------------------------------------------- runtimes
Loaded = tuple[ModelBackend, object, list[int]]  # backend, tokenizer (or None), EOS ids


@dataclass(frozen=True)
class LoadRequest:
    """One model to load, as `backends/load.start_backend` was asked for it."""

    name: str
    dtype: str
    weights: str  # a concrete variant (never `fastest`)
    role: str  # "target" | "draft"
    device: str  # a resolved device: cpu | cuda
    tokenizer_like: str | None = None  # another model whose tokenizer files may be the same
    sequences: int = 1  # sequences a multi-sequence runtime holds


@dataclass(frozen=True)
class Runtime:
    """A runtime as the registry (`backends/runtimes.py`) lists it: each runtime package's
    `runtime.py` defines one."""

    name: str
    weights: tuple[str, ...]  # the weights variants it runs
    devices: tuple[str, ...]
    can_run: Callable[[str], bool]  # whether it is installed and can read model `name`
    begin_load: Callable[[LoadRequest], Callable[[], Loaded]]  # starts loading; returns `finish`
    fastest_on: tuple[str, ...] | None = None  # devices `fastest` may pick it on (all)
    batches: bool = False  # decodes several sequences in one call (`serve --max-batch`)
    # its sequences share one pool of KV cells: an idle sequence costs nothing until its
    # cells are needed (ik_llama.cpp; the static runtime preallocates and computes every row)
    pooled_cache: bool = False


END_MARKERS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>")


def eos_ids_of(model, tokenizer) -> list[int]:
    """EOS ids from the generation config (Qwen instruct stops on <|im_end|> and
    <|endoftext|>) and the tokenizer."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        # GGUF conversions often list only the chat end marker; plain end-of-text ends too.
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        ids.update(vocab[t] for t in END_MARKERS if t in vocab)
    return sorted(ids)
