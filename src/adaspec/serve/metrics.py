"""Prometheus metrics of one server (its own registry: several apps in one process, as in
the tests, do not share counters). Method labels carry the method's name only (`draft`,
`ngram`, ...), never the whole string a client sent, so the label set stays small."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 (re-export)
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from adaspec.core.metrics import RequestStats
from adaspec.engine.batch import RoundStats

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0)
RATE_BUCKETS = (1, 2, 5, 10, 15, 20, 30, 40, 60, 80, 120, 200, 400, 1000)
SHARE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


def method_label(method: str) -> str:
    return method.partition("@")[0].partition(":")[0].strip() or "unknown"


def _reader(read: Callable[[], dict[str, int]], key: str) -> Callable[[], float]:
    return lambda: float(read().get(key, 0))


class ServeMetrics:
    def __init__(self, queue_depth: Callable[[], float], busy: Callable[[], float],
                 prefix_cache: Callable[[], dict[str, int]] | None = None) -> None:
        disable_created_metrics()  # no `_created` twin of every counter (process-wide)
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "adaspec_requests", "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"], registry=r)
        self.outcomes = Counter(
            "adaspec_generations", "generations by how they ended: stop, length, cancelled "
            "(client gone), timeout, error", ["method", "outcome"], registry=r)
        Gauge("adaspec_queue_depth", "requests waiting for the model",
              registry=r).set_function(queue_depth)
        Gauge("adaspec_busy", "1 while the model decodes a request (one at a time)",
              registry=r).set_function(busy)
        self.prompt_tokens = Counter("adaspec_prompt_tokens", "prompt tokens prefilled",
                                     ["method"], registry=r)
        self.cached_tokens = Counter(
            "adaspec_prompt_tokens_cached", "prompt tokens the KV cache already held (not "
            "computed again: a conversation's earlier turns, a shared system turn)", ["method"],
            registry=r)
        if prefix_cache is not None:  # continuous batching: what idle slots keep
            for key, text in (("kept", "idle KV cache slots keeping a finished request's "
                               "tokens for its conversation's next turn"),
                              ("kept_tokens", "tokens those idle slots keep"),
                              ("evicted", "idle slots' tokens dropped, least recently used "
                               "first: for room, or taken by another conversation")):
                Gauge(f"adaspec_prefix_cache_{key}", text, registry=r).set_function(
                    _reader(prefix_cache, key))
        self.generated_tokens = Counter("adaspec_generated_tokens", "tokens generated",
                                        ["method"], registry=r)
        self.drafted = Counter("adaspec_drafted_tokens", "draft tokens sent to verification",
                               ["method"], registry=r)
        self.accepted = Counter("adaspec_accepted_tokens", "draft tokens the target accepted",
                                ["method"], registry=r)
        self.target_calls = Counter("adaspec_target_calls", "target forward passes",
                                    ["method"], registry=r)
        self.ttft = Histogram(
            "adaspec_time_to_first_token_seconds",
            "from the request's arrival to its first token (queue wait included)",
            ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("adaspec_queue_wait_seconds",
                                    "from arrival to the model starting on the request",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("adaspec_request_duration_seconds",
                                  "from arrival to the last token", ["method"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.tokens_per_s = Histogram("adaspec_tokens_per_second",
                                      "new tokens per second of decoding, per request",
                                      ["method"], buckets=RATE_BUCKETS, registry=r)
        self.acceptance = Histogram("adaspec_acceptance_rate",
                                    "accepted / drafted draft tokens, per request that drafted",
                                    ["method"], buckets=SHARE_BUCKETS, registry=r)

        # continuous batching (--max-batch > 1): where the worker's time goes, round by round
        self.rounds = Counter(
            "adaspec_batch_rounds", "batched rounds (one target call each), by kind: prefill "
            "(the call carried prompt chunks) or decode", ["kind"], registry=r)
        self.round_seconds = Counter(
            "adaspec_batch_round_seconds", "seconds in the rounds' target calls, by kind",
            ["kind"], registry=r)
        self.round_tokens = Counter(
            "adaspec_batch_tokens", "tokens the rounds' calls scored, by part: prompt (prefill "
            "chunks), step (each request's token and the drafts verified), and drafted tokens "
            "the batch pricing cut before the call (cut, not scored)", ["part"], registry=r)
        self.round_modelled = Counter(
            "adaspec_batch_round_modelled_seconds", "the rounds' calls priced by the batch "
            "cost curve, by kind (modelled, not timed: the same calls read the same whatever "
            "else slows the machine)", ["kind"], registry=r)
        self.round_requests = Histogram(
            "adaspec_batch_requests", "requests in a round's call", buckets=ROW_BUCKETS,
            registry=r)

    def batch_round(self, stats: RoundStats, modelled_ms: float | None = None) -> None:
        """One batched round, as engine/batch.py's decoder reports it (modelled_ms: its call
        priced by the batch cost curve, where the batch is priced)."""
        kind = "prefill" if stats.prefill_tokens else "decode"
        self.rounds.labels(kind).inc()
        self.round_seconds.labels(kind).inc(stats.call_seconds)
        if modelled_ms is not None:
            self.round_modelled.labels(kind).inc(modelled_ms / 1000)
        self.round_tokens.labels("prompt").inc(stats.prefill_tokens)
        self.round_tokens.labels("step").inc(stats.tokens - stats.prefill_tokens)
        self.round_tokens.labels("cut").inc(stats.cut)
        self.round_requests.observe(stats.sequences)

    def finished(self, method: str, stats: RequestStats, finish: str, ttft: float | None,
                 duration: float) -> None:
        m = method_label(method)
        self.outcomes.labels(m, finish).inc()
        self.prompt_tokens.labels(m).inc(stats.prompt_tokens)
        self.cached_tokens.labels(m).inc(stats.cached_tokens)
        self.generated_tokens.labels(m).inc(stats.new_tokens)
        self.drafted.labels(m).inc(stats.drafted)
        self.accepted.labels(m).inc(stats.accepted)
        self.target_calls.labels(m).inc(stats.target_calls)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
        self.duration.labels(m).observe(duration)
        self.tokens_per_s.labels(m).observe(stats.tokens_per_s)
        if stats.drafted:
            self.acceptance.labels(m).observe(stats.acceptance_rate)

    def ended_early(self, method: str, outcome: str) -> None:
        self.outcomes.labels(method_label(method), outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
