"""The one driver of requests' decode loops (`BatchDecoder`): requests decoded together
(continuous batching), one target call per round for all; a request alone is a batch of one
(`run_alone`).

Each request keeps its own engine (drafter, length controller, verifier), sampling
parameters, random generator, stop rules and stats: it runs as `Engine.steps`, which yields
the target calls it needs. A round
  1. runs every request until it needs the target (its drafter proposes on its own);
  2. gives each waiting prompt a chunk of its prefill (at most `prefill_tokens` a round in
     all), so a long prompt never holds the others up for more than a chunk;
  3. cuts the drafts to what pays over the whole batch (`choose_lengths`): a drafted token
     is verified where the time the batch's work is expected to end sooner by (its
     acceptance times `BatchLoad.token_ms`, which depends on whether the batch's end waits
     on its request) exceeds the time it adds to the call;
  4. scores everything in one call of the runtime (`backends/sequences.forward_together`);
     each request verifies on its own rows in its next round.
A request that fails is dropped with its error; the others go on. A round's chunks can be
handed on before its calls run (`advance`, then `run`), so a client sees a step's tokens
without waiting for the next step's call.
"""

from __future__ import annotations

import heapq
import operator
import sys
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from itertools import accumulate

from adaspec.backends.base import ForwardOutput, common_prefix
from adaspec.backends.sequences import (
    ALL,
    LAST,
    MIN_SHARE,
    NONE,
    SequenceView,
    score_together,
)
from adaspec.cost.batch import BatchCostFn, BatchLoad, Seat
from adaspec.engine.steps import GenerationResult, StreamChunk, TargetCall

PREFILL_TOKENS = 256  # prompt tokens a round may carry, in all


@dataclass
class _Member:
    key: Hashable
    steps: Iterator[StreamChunk | GenerationResult | TargetCall]
    seat: Seat  # its round and pace (its drafter prices against it where it joined)
    call: TargetCall | None = None
    prompt_left: list[int] | None = None  # a chunked prefill's tokens still to feed


@dataclass
class RoundStats:
    """What the last round did (for metrics and tests)."""

    sequences: int = 0
    tokens: int = 0  # scored by the round's calls (prompt chunks included)
    prefill_tokens: int = 0  # prompt tokens (a prompt run alone: as sent, before cache reuse)
    drafted: int = 0  # drafted tokens verified
    cut: int = 0  # drafted tokens the pricing left out
    lengths: list[int] = field(default_factory=list)
    call_seconds: float = 0.0  # the round's calls to the runtime (the batched one, any alone)


def choose_lengths(accepts: list[list[float] | None], fixed_tokens: int,
                   cost: BatchCostFn, worth: list[float]) -> list[int]:
    """How many drafted tokens of each request one call verifies. accepts[i]: request i's
    drafted levels' acceptance estimates (None: its draft is fixed, verified whole, counted in
    `fixed_tokens` with the call's other tokens beyond one per request); worth[i]: ms the
    batch's work ends sooner by when request i emits one token more (`BatchLoad.token_ms`).
    Adds drafted tokens in order of expected ms saved and keeps the count that saves the most
    net of what they add to the call; verifying no draft saves nothing, so the choice never
    expects the batch to end later than without speculation."""
    sequences = len(accepts)
    tokens = sequences + fixed_tokens
    plain = cost(tokens, sequences)
    saved = best = 0.0
    lengths = [0] * len(accepts)
    best_lengths = list(lengths)
    heap = [(-a[0] * worth[i], i, 0, a[0]) for i, a in enumerate(accepts) if a]
    heapq.heapify(heap)
    while heap:
        gain_ms, i, level, p = heapq.heappop(heap)
        lengths[i] = level + 1
        tokens += 1
        saved -= gain_ms
        net = saved - (cost(tokens, sequences) - plain)
        if net > best:
            best, best_lengths = net, list(lengths)
        a = accepts[i]
        assert a is not None
        if level + 1 < len(a):
            p *= a[level + 1]
            heapq.heappush(heap, (-p * worth[i], i, level + 1, p))
    return best_lengths


def _batchable(call: TargetCall | None) -> bool:
    return (call is not None and isinstance(call.backend, SequenceView)
            and call.mask is None and call.positions is None)


class BatchDecoder:
    """The requests being decoded together, keyed by the caller's handle."""

    def __init__(self, cost: BatchCostFn | None = None,
                 prefill_tokens: int = PREFILL_TOKENS, share_calls: bool = True) -> None:
        """cost: ms of a call by (total tokens, sequences); None: drafts are verified as
        their engines proposed them (no batch pricing). share_calls: the requests' calls on
        sequences of one runtime go in one call of it (False: each runs on its own)."""
        self.cost = cost
        self.prefill_tokens = max(1, prefill_tokens)
        self.share_calls = share_calls
        self._members: dict[Hashable, _Member] = {}
        self.last = RoundStats()
        self.load = BatchLoad()  # the round the joined engines' drafters price against
        self.waiting = 0  # requests queued for a place (a server sets it before a round)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._members

    def seat(self) -> Seat:
        """A place in this batch's rounds for a request about to join: handed to its steps
        (`TextGenerator.stream_steps(seat=...)`), its drafter prices what it drafts against
        the rounds (`cost.batch.BatchLoad`) rather than as a request alone."""
        return Seat(self.load)

    def add(self, key: Hashable, steps: Iterator[StreamChunk | GenerationResult | TargetCall],
            seat: Seat | None = None) -> None:
        """seat: the one `steps` were given (`seat()`), which the rounds keep the pace of."""
        if key in self._members:
            raise ValueError(f"request {key!r} is already decoding")
        self._members[key] = _Member(key, steps, seat or Seat(self.load))

    def modelled_ms(self) -> float | None:
        """The last round's call priced by the batch cost (None: unpriced, or no call): the
        same calls read the same on a machine whose speed drifts, so methods compare by the
        calls they chose."""
        last = self.last
        return self.cost(last.tokens, last.sequences) if self.cost and last.sequences else None

    def drop(self, key: Hashable) -> None:
        """Stop a request where it is (its sequence is free for the next one)."""
        member = self._members.pop(key, None)
        if member is not None:
            close = getattr(member.steps, "close", None)
            if close is not None:
                close()

    def round(self) -> list[tuple[Hashable, StreamChunk | GenerationResult | Exception]]:
        """One round (see the module's docstring): what each request produced, in order; a
        request ends after its GenerationResult or its Exception."""
        events = self.advance()
        return events + self.run()

    def advance(self) -> list[tuple[Hashable, StreamChunk | GenerationResult | Exception]]:
        """A round's first half: every request runs until it needs the target; what each
        produced on the way, in order (a request ends after its GenerationResult or its
        Exception). `run` then scores the calls."""
        self._open_round()
        events: list[tuple[Hashable, StreamChunk | GenerationResult | Exception]] = []
        for member in list(self._members.values()):
            events += self._until_call(member)
        return events

    def advance_one(self, key: Hashable
                    ) -> Iterator[tuple[Hashable, StreamChunk | GenerationResult | Exception]]:
        """`advance` for a batch of one request, its output handed on as it comes (so its
        caller sees a step's tokens before the next step drafts)."""
        self._open_round()
        member = self._members.get(key)
        if member is not None:
            yield from self._until_call(member)

    def _open_round(self) -> None:
        """The round's load, which the joined requests' drafters price against."""
        filling = [m.prompt_left for m in self._members.values() if m.prompt_left]
        self.load.cost, self.load.prompts = self.cost, len(filling)
        self.load.sequences = max(1, len(self._members) - len(filling))
        self.load.prompt_tokens = min(self.prefill_tokens, sum(len(p) for p in filling))
        self._note_budgets()
        self.load.waiting = self.waiting

    def _until_call(self, member: _Member
                    ) -> Iterator[tuple[Hashable, StreamChunk | GenerationResult | Exception]]:
        """Run one request until it needs the target (`member.call`), yielding what it
        produces on the way as it comes."""
        if member.call is not None and member.call.out is None:
            return  # a prefill still in chunks
        member.call = None
        try:
            while True:
                item = next(member.steps)
                if isinstance(item, TargetCall):
                    member.call = item
                    return
                if isinstance(item, GenerationResult):
                    self._members.pop(member.key, None)
                yield member.key, item
                if isinstance(item, GenerationResult):
                    return
        except StopIteration:
            self._members.pop(member.key, None)
        except Exception as exc:  # this request's own failure: the others go on
            self.drop(member.key)
            yield member.key, exc

    def run(self) -> list[tuple[Hashable, Exception]]:
        """A round's second half: the calls `advance` stopped at, scored (one call of the
        runtime for the batchable ones); the requests whose call failed, with the error."""
        events: list = []
        self._run_calls(events)
        return events

    def _note_budgets(self) -> None:
        """Put in the round's load every request's tokens left to emit, as its last call
        said (a prompt being prefilled: its whole budget), and its pace (`Seat`)."""
        members = [m for m in self._members.values() if m.call is not None]
        self.load.budgets = [m.call.remaining for m in members if m.call is not None]
        self.load.paces = [m.seat.pace for m in members]

    def _run_calls(self, events: list) -> None:
        stats = RoundStats()
        steps: list[_Member] = []
        chunks: list[tuple[_Member, list[int], str]] = []
        alone: list[_Member] = []
        budget = self.prefill_tokens
        for member in self._members.values():
            call = member.call
            if call is None:
                continue
            view = (call.backend if self.share_calls and isinstance(call.backend, SequenceView)
                    else None)
            if call.prompt_reuse is None:
                steps.append(member)
            elif view is None:
                alone.append(member)
            else:
                if budget <= 0:
                    continue  # its next chunk waits for the next round
                if member.prompt_left is None:
                    ids = call.tokens.tolist()
                    if self._wait_for_prefix(view, ids, call.prompt_reuse):
                        continue
                    member.prompt_left = view.plan_prefill(ids, call.prompt_reuse)
                    call.cached = len(ids) - len(member.prompt_left)
                chunk, member.prompt_left = (member.prompt_left[:budget],
                                             member.prompt_left[budget:])
                budget -= len(chunk)
                chunks.append((member, chunk, NONE if member.prompt_left else LAST))
        prefill = sum(len(c) for _, c, _ in chunks)
        self._price(steps, prefill, len(chunks), stats)
        # chains on sequences of one runtime go in one call; anything else runs on its own
        alone += [m for m in steps if not (self.share_calls and _batchable(m.call))]
        steps = [m for m in steps if self.share_calls and _batchable(m.call)]
        items = [(m.call.backend, m.call.tokens.tolist(), ALL) for m in steps if m.call]
        items += [(m.call.backend, chunk, rows) for m, chunk, rows in chunks if m.call]
        owners = steps + [m for m, _, _ in chunks]
        t0 = time.perf_counter()
        try:
            results: list[ForwardOutput | None] = list(score_together(items)) if items else []
        except Exception:  # find whose call failed: each on its own
            results = []
            for member, item in zip(owners, items, strict=True):
                try:
                    results.extend(score_together([item]))
                except Exception as exc:
                    events.append((member.key, exc))
                    self.drop(member.key)
                    results.append(None)
        seconds = time.perf_counter() - t0
        for member, scored in zip(owners, results, strict=True):
            if scored is None or member.call is None:
                continue
            if member.prompt_left:  # more chunks to come
                continue
            member.call.out = scored
            member.call.seconds = seconds  # each request waited for the whole call
            member.prompt_left = None
        stats.tokens = sum(len(i[1]) for i in items)
        for member in alone:
            assert member.call is not None
            try:
                member.call.run()
            except Exception as exc:
                events.append((member.key, exc))
                self.drop(member.key)
            sent = len(member.call.tokens)
            stats.tokens += sent
            prefill += sent if member.call.prompt_reuse is not None else 0
            seconds += member.call.seconds
        stats.sequences = len(items) + len(alone)
        stats.prefill_tokens = prefill
        stats.call_seconds = seconds
        self.last = stats

    def _wait_for_prefix(self, view: SequenceView, ids: list[int], reuse: int) -> bool:
        """Whether a prompt should start its prefill a round later: another prompt being
        prefilled on the same runtime will by then hold at least MIN_SHARE more of its
        leading tokens than any cache does now (`SequenceView.plan_prefill` then shares
        them instead of computing them twice, e.g. a chat template's system turn)."""
        filling = [m.call.tokens.tolist() for m in self._members.values()
                   if m.prompt_left is not None and m.call is not None
                   and isinstance(m.call.backend, SequenceView)
                   and m.call.backend.owner is view.owner and m.call.backend is not view]
        if not filling:
            return False
        coming = min(max(common_prefix(ids, p) for p in filling), len(ids) - 1, reuse)
        return coming - view.available_prefix(ids, reuse) >= MIN_SHARE

    def _price(self, steps: list[_Member], prefill: int, chunks: int, stats: RoundStats) -> None:
        calls = [m.call for m in steps if m.call is not None]
        accepts: list[list[float] | None] = []
        fixed = prefill
        for member in steps:
            call = member.call
            assert call is not None
            proposal = call.proposal
            depth = proposal.depth if proposal is not None else 0
            levels = list(proposal.accept or [0.5] * depth) if proposal is not None else []
            member.seat.steps_seen += 1
            member.seat.tokens_seen += 1 + sum(accumulate(levels, operator.mul))
            if proposal is None or depth == 0:
                accepts.append([])
            elif call.fixed or not proposal.is_chain or self.cost is None:
                accepts.append(None)
                fixed += depth
            else:
                accepts.append(levels)
        # A request alone in its round, with no prompt beside it and none queued: its
        # drafter priced its step alone and it is verified as proposed, as `run_alone` does.
        # (The batch's worth of its token, a call over the pace its own drafts promise,
        # undervalued the drafts that make that pace: once a plain step got twice as cheap
        # on a 2-vCPU AMD EPYC, a lone request's n-gram and history drafts were cut to
        # nothing, 1.04x `ar` on code edits through the server.)
        alone = len(steps) == 1 and not (prefill or chunks or self.waiting)
        cost = self.cost
        if cost is not None and calls:
            self.load.cost = cost
            self._note_budgets()  # this round's, each step's own included
        if cost is not None and calls and not alone:
            worth = [self.load.token_ms(m.call.remaining, m.seat.pace) for m in steps
                     if m.call is not None]
            lengths = choose_lengths(accepts, fixed, lambda n, s: cost(n, s + chunks), worth)
        else:
            lengths = [len(a) if a else 0 for a in accepts]
        for call, a, n in zip(calls, accepts, lengths, strict=True):
            if a is None:
                assert call.proposal is not None
                stats.drafted += call.proposal.depth
                stats.lengths.append(call.proposal.depth)
                continue
            if n < len(a):
                call.cut(n)
                stats.cut += len(a) - n
            stats.drafted += n
            stats.lengths.append(n)


def run_alone(
    steps: Iterator[StreamChunk | GenerationResult | TargetCall],
) -> Iterator[StreamChunk | GenerationResult]:
    """Drive one request alone: a batch of one (the same driver as requests decoded
    together) whose chunks reach the caller as its steps make them, before its next step
    drafts, and whose calls run as they come, whole (no one to share a call or a prompt's
    chunks with). A failure is raised."""
    batch = BatchDecoder(prefill_tokens=sys.maxsize, share_calls=False)
    batch.add("alone", steps)
    try:
        while "alone" in batch:
            for _, item in batch.advance_one("alone"):
                if isinstance(item, Exception):
                    raise item
                yield item
            for _, exc in batch.run():
                raise exc
    finally:
        batch.drop("alone")
