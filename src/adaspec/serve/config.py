"""What `adaspec serve` was started with: the models, the default method and the limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adaspec.backends.weights import FASTEST
from adaspec.draft.history import DEFAULT_BUDGET
from adaspec.methods.spec import DEFAULT_METHOD, parse_method
from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT

API_KEY_ENV = "ADASPEC_API_KEY"
# `--max-batch auto` where the target's runtime decodes several requests in one call: the
# slots llama-server opens by default
AUTO_SLOTS = 4
# sequences of the KV cache per request decoded together, by default, where the runtime
# keeps them in one pool of cells (ik_llama.cpp): a finished request's tokens stay in its
# sequence for its conversation's next turn (`ServeConfig.cache_slots`)
KEPT_PER_SLOT = 4


@dataclass(frozen=True)
class ServeConfig:
    method: str = DEFAULT_METHOD  # a request's `method` field overrides it
    target: str = TARGET_DEFAULT
    draft: str | None = DRAFT_DEFAULT
    dtype: str = "bfloat16"
    weights: str = FASTEST  # `fastest`, a torch quantization or a llama.cpp runtime
    draft_weights: str = FASTEST
    device: str = "auto"  # backends/device.py: where the models run
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 16  # requests waiting behind the ones being decoded; more get 429
    max_batch: int = 1  # requests decoded together (sequences of one KV cache); `serve`: auto
    # sequences of the KV cache (at least max_batch; `serve`: `auto_cache_slots`): an idle
    # one keeps its last request's prompt and answer until a request needs its room, least
    # recently used first, so a conversation's next turn prefills only what it adds
    cache_slots: int = 0
    timeout: float = 600.0  # seconds from arrival to the last token; then 504 (or an error event)
    api_key: str | None = None
    model_name: str | None = None  # the id /v1/models lists (default: the target's name)
    default_max_tokens: int = 512  # when a request gives no max_tokens (capped by the context)
    drain_timeout: float | None = None  # SIGTERM: wait this long for in-flight requests
    max_engines: int = 16  # methods kept built (least recently used go); a request gets its own
    online: Any = None  # an online.service.OnlineConfig: distil the draft on served traffic
    # the cross-request history: a file, "" for $ADASPEC_HOME/history/<target>.history, or
    # "off" (kept in memory only); saved every history_every finished requests and at exit
    history: str = ""
    history_every: int = 16
    history_tokens: int = DEFAULT_BUDGET  # the most tokens it holds

    def slots(self) -> str:
        """How requests are decoded, for the startup line."""
        if self.max_batch <= 1:
            return "one request at a time"
        kept = self.sequences()
        return f"{self.max_batch} requests decoded together" + (
            f", {kept} conversations kept in the KV cache" if kept > self.max_batch else "")

    def sequences(self) -> int:
        """Sequences of the target's KV cache for the requests decoded together and the
        conversations kept (`cache_slots`); 1 decoding one request at a time."""
        if self.max_batch <= 1:
            return 1
        return max(self.max_batch, self.cache_slots)

    def served_name(self) -> str:
        if self.model_name:
            return self.model_name
        return self.target.rstrip("/").rsplit("/", 1)[-1]


def _runtime_weights(method: str, target: str, weights: str, device: str) -> tuple[str, str]:
    """The target's weights variant (the method's own `@weights`, else `weights`; `fastest`
    resolved for the device) and the resolved device."""
    from adaspec.backends.device import resolve_device
    from adaspec.backends.runtimes import fastest_weights

    where = resolve_device(device)
    chosen = parse_method(method).weights or weights
    if chosen == FASTEST:
        chosen = fastest_weights(target, where)
    return chosen, where


def auto_cache_slots(method: str, target: str, weights: str, device: str,
                     max_batch: int) -> int:
    """`adaspec serve`'s default sequences of the KV cache: KEPT_PER_SLOT per request decoded
    together where the runtime pools its cells (ik_llama.cpp), else one per request (the
    static runtime computes every row it holds)."""
    from adaspec.backends.runtimes import pools_cache

    if max_batch <= 1:
        return 1
    return KEPT_PER_SLOT * max_batch if pools_cache(*_runtime_weights(
        method, target, weights, device)) else max_batch


def auto_max_batch(method: str, target: str, weights: str, device: str) -> int:
    """`adaspec serve`'s default slots: AUTO_SLOTS where the target's runtime (the method's
    own `@weights`, else `weights`; `fastest` resolved for the device) decodes several
    requests in one call, else 1 (one at a time, the others queued)."""
    from adaspec.backends.runtimes import batches

    return AUTO_SLOTS if batches(*_runtime_weights(method, target, weights, device)) else 1
