"""`auto`: at every step, propose whatever maximizes expected tokens per second on this
machine: nothing (a plain step), an n-gram continuation from this request, a continuation from
earlier requests (the history, `draft/history.py`), or a draft-model continuation, and how
many tokens of it.

The price of every option comes from the machine's cost profile (target forward for n tokens,
draft forward, loop overhead); its value is the expected number of tokens the step emits,
1 + sum_i P(first i drafted tokens accepted), with per-token acceptance estimated from
verification results: per n-gram match length for n-gram proposals, per draft confidence (top
probability) bucket for draft tokens (both from this request's own steps), and per (match
length, confidence) cell for history tokens (over the engine's recent requests, as the history
itself spans requests), each a Beta posterior around a prior.
A draft-model continuation stops token by token, when no look-ahead of up to three more
tokens would raise the step's expected tokens per millisecond.

Exactness is the verifier's business, as for every method: n-gram proposals are
deterministic (q is one-hot), and so are history proposals; draft proposals carry the
draft's processed distribution. A seeded request at temperature > 0 does not draft from the
history, so its output stays the same whatever the engine served before (greedy output is the
target's anyway).

The history learns from what the engine served: `start` (the next request) and `learn` hand
the previous request's prompt and output, as the last `commit` saw them, to the index.
"""

from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass, field, replace
from itertools import accumulate

import torch

from adaspec.control.base import LengthController
from adaspec.core.proposal import Proposal
from adaspec.core.request import RequestState
from adaspec.core.sampling import SamplingParams, draw
from adaspec.cost.batch import Seat
from adaspec.cost.live import LiveScale
from adaspec.cost.profile import CostProfile
from adaspec.cost.rule import cost_keeps_drafting
from adaspec.draft.base import Drafter
from adaspec.draft.head import HeadChain, HeadDrafter
from adaspec.draft.head_tree import best_counts, level_tree
from adaspec.draft.history import HistoryIndex
from adaspec.draft.model import ModelDrafter
from adaspec.draft.ngram import NgramDrafter
from adaspec.draft.rates import RateEstimate

CONFIDENCE_EDGES = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98)  # bucket upper edges (last: 1.0)
NGRAM_PRIORS = {1: 0.3, 2: 0.45, 3: 0.6, 4: 0.7}  # per-token acceptance by match length
DRAFT_PRIOR = 0.6  # the draft model's per-token acceptance before any evidence
HEAD_PRIOR = 0.4  # the draft head's, before any evidence
HEAD_WINDOW = 200.0  # trials a head estimate remembers across requests
HEAD_MS_WINDOW = 8.0  # head steps the learned price of a step remembers (`learn_head_ms`)
# The head's rates span requests, but a request can suit it worse (or better) than the ones
# before: each request scales them by (accepted + w) / (expected + w) over its own head
# tokens (those verified, and at greedy the peeked first tokens a step did not propose,
# checked against the token the step emitted there), with w this many expected tokens. On a
# ShareGPT prompt where the head's tokens landed 0.33 of the time, `auto` ran at 0.94x `ar`'s
# speed through the server (session 44): the cross-request rates kept it drafting.
HEAD_REQUEST_WEIGHT = 4.0
clock = time.perf_counter  # times a head step (`learn_head_ms`); tests set a fake one
# Tokens a request must have emitted in steps alone before the rate those steps were priced
# at says whether starting the draft model pays (`_rate_without_draft`).
RATE_EVIDENCE = 8
# The draft's acceptance over the engine's recent requests (at most this many trials, older
# ones fading) is the next request's prior: a run of requests the draft serves badly (short
# translations with a code draft) stops starting it and paying its prompt prefill, a run it
# serves well starts it sooner. Per request, its own steps take over as usual.
DRAFT_MEMORY = 48.0
# History tokens: per-token acceptance by the n-gram length their lookup matched (classes
# 1-2, 3, 4-7, 8+) and their confidence count / (total + 1), bucketed at these upper edges (a
# continuation seen once has 0.5; three times out of three, 0.75; nine out of nine, 0.9).
HISTORY_EDGES = (0.5, 0.75, 0.9)
HISTORY_ORDERS = (1, 3, 4, 8)  # each class: from this length to the next
HISTORY_WINDOW = 200.0  # trials a history estimate remembers across requests
# A history token "on a run": the history predicted at least this many of the tokens just
# before it (emitted, or drafted ahead of it in the same proposal). A request that repeats an
# earlier answer keeps the history on a run; a generic n-gram match seldom does.
HISTORY_RUN = 4


def _bucket_of(confidence: float) -> int:
    for i, edge in enumerate(CONFIDENCE_EDGES):
        if confidence < edge:
            return i
    return len(CONFIDENCE_EDGES)


# a drafted token's next candidates: their tokens and the head's probability of each
Candidates = tuple[list[int], list[float]]
# auto:tree=priced: candidates a level offers beside the chain's token, most nodes a step
TREE_SIBLINGS = 3
TREE_NODES = 16


def _head_token(chain: HeadChain, params: SamplingParams, generator: torch.Generator | None,
                siblings: int = 0) -> tuple[int, torch.Tensor | None, int, Candidates]:
    """The head's next drafted token, its processed distribution (None: greedy), its
    confidence bucket and (`siblings` > 0) its next candidates after the drafted one with
    the head's probability of each, read back in one transfer."""
    drawn, processed, small = chain.draw(params, generator)
    probs = torch.softmax(small, dim=-1)
    if not siblings:
        read = torch.cat([drawn.double(), probs.max().reshape(1).double()]).tolist()
        return int(read[0]), processed, _bucket_of(read[1]), ([], [])
    top = torch.topk(probs, min(siblings + 1, probs.shape[-1]))
    ids = chain.token_ids[top.indices]
    read = torch.cat([drawn.double(), top.values.double(), ids.double()]).tolist()
    token, width = int(read[0]), len(top.values)
    others = [(int(t), q) for q, t in zip(read[1 : 1 + width], read[1 + width :], strict=True)
              if int(t) != token][:siblings]
    return token, processed, _bucket_of(read[1]), ([t for t, _ in others],
                                                   [q for _, q in others])


def _bucket_prior(i: int) -> float:
    lo = 0.0 if i == 0 else CONFIDENCE_EDGES[i - 1]
    hi = 1.0 if i == len(CONFIDENCE_EDGES) else CONFIDENCE_EDGES[i]
    return 0.9 * (lo + hi) / 2  # a small draft is a little over-confident


def history_cell(order: int, confidence: float, run: int = 0) -> tuple[int, int, int]:
    """The estimate a history token is priced and credited by: its match length, its
    confidence bucket, and whether the history is on a run (`run` tokens right before it)."""
    bucket = len(HISTORY_EDGES)
    for i, edge in enumerate(HISTORY_EDGES):
        if confidence < edge:
            bucket = i
            break
    length = max(c for c in HISTORY_ORDERS if c <= max(order, 1))
    return length, bucket, int(run >= HISTORY_RUN)


def _shadow_outcome(seen: Choice, context: list[int]) -> tuple[int, int]:
    """(trials, accepted) of a continuation that was not proposed, by the tokens its step
    emitted: token i is a trial when the tokens before it were emitted, accepted when it
    equals the emitted one. That is what its verification would have given (greedy: the
    target's token; sampling: the emitted token equals a one-hot proposal's with the
    probability it is accepted), so an estimate learns without paying for a verification:
    on a 2-vCPU AMD EPYC whose plain step became twice as cheap as before, the n-gram's
    priors no longer paid for a first proposal, so `auto` never saw how well a code edit's
    n-grams do (1.04x `ar` through the server, against 2.31x the run before)."""
    emitted = context[seen.start:]
    trials = accepted = 0
    for drafted, token in zip(seen.tokens, emitted, strict=False):
        trials += 1
        if drafted != token:
            break
        accepted += 1
    return trials, accepted


# Priors per cell: (match length class, confidence bucket) -> (off a run, on a run), measured
# as auto credits its estimates: 1M tokens of ShareGPT answers indexed, 200 other answers
# decoded again with the history proposing up to 8 tokens a step, a token counted when those
# before it in its step were right (experiments/history_cost.py, n-grams of 3, 4 and 8;
# lengths 1-2 from an index of 2, 3 and 4). Rounded, and made to rise with the confidence.
HISTORY_PRIORS = {
    1: ((0.12, 0.25, 0.5, 0.8), (0.15, 0.35, 0.6, 0.85)),
    3: ((0.12, 0.25, 0.57, 0.86), (0.15, 0.35, 0.65, 0.9)),
    4: ((0.16, 0.28, 0.6, 0.91), (0.15, 0.43, 0.74, 0.95)),
    8: ((0.26, 0.46, 0.6, 0.9), (0.25, 0.72, 0.75, 0.92)),
}


def _history_prior(cell: tuple[int, int, int]) -> float:
    length, bucket, on_run = cell
    return HISTORY_PRIORS[length][on_run][bucket]


@dataclass
class Choice:
    """What the last step proposed: enough to credit its outcome to the right estimate."""

    kind: str  # "plain" | "ngram" | "history" | "draft" | "head"
    tokens: list[int] = field(default_factory=list)
    start: int = 0  # context length when proposed
    match: int = 0  # n-gram match length
    buckets: list = field(default_factory=list)  # per token: draft bucket | history cell
    # a head tree: the nodes of `tokens` (its chain) and every node it verified (None: a
    # chain, its tokens the nodes)
    nodes: list[int] | None = None
    rows: int = 0

    def accepted(self, path: list[int]) -> int:
        """Of `tokens`, how many the verdict's `path` (accepted nodes) kept."""
        if self.nodes is None:
            return len(path)
        n = 0
        while n < min(len(path), len(self.nodes)) and path[n] == self.nodes[n]:
            n += 1
        return n


@dataclass
class _Peek:
    """The head's first token of a step, drafted before the step chose (`_peek_head`)."""

    chain: HeadChain
    token: int
    probs: torch.Tensor | None  # its processed distribution [V] (None: greedy)
    bucket: int
    n: int  # the best chain length its bucket's rate gives
    value: float  # that chain's expected tokens per ms
    siblings: Candidates  # the head's next candidates beside it (tree=priced)


@dataclass
class AutoStats:
    """How often each kind of step was chosen (for reports)."""

    plain: int = 0
    ngram: int = 0
    history: int = 0
    draft: int = 0
    head: int = 0


@dataclass(eq=False)
class AutoMemory:
    """What `auto` learns across requests: the history's and the head's acceptance, the
    draft model's recent rate, the price of a head step here. One request's estimates live in
    the drafter; this is the method's, so a server's engines of one method (one per slot)
    share one (`AutoDrafter.learn_with`) and learn from every slot's requests."""

    head_ms: float = 0.0  # what a head step costs here (learned: `learn_head_ms`)
    history_rates: dict[tuple[int, int, int], RateEstimate] = field(default_factory=lambda: {
        (o, b, r): RateEstimate(_history_prior((o, b, r)))
        for o in HISTORY_ORDERS for b in range(len(HISTORY_EDGES) + 1) for r in (0, 1)})
    history_outcomes: list[int] = field(default_factory=lambda: [0, 0])  # drafted, accepted
    draft_memory: RateEstimate = field(default_factory=lambda: RateEstimate(DRAFT_PRIOR))
    # the head's acceptance per confidence bucket and overall (the last HEAD_WINDOW trials
    # each): a short answer (a translation) ends before its own steps could tell whether the
    # head pays
    head_rates: list[RateEstimate] = field(default_factory=lambda: [
        RateEstimate(_bucket_prior(i)) for i in range(len(CONFIDENCE_EDGES) + 1)])
    head_overall: RateEstimate = field(default_factory=lambda: RateEstimate(HEAD_PRIOR))
    head_seen: list[float] = field(  # peeks per bucket (fading)
        default_factory=lambda: [1.0] * (len(CONFIDENCE_EDGES) + 1))
    # what the target's calls of each row count took against the profile's price, from the
    # steps priced alone (`learn_prices`)
    call_scale: LiveScale = field(default_factory=LiveScale)


class AutoDrafter(Drafter):
    """The cost-aware choice between no draft, an n-gram draft, a history draft and a draft
    model."""

    name = "auto"

    def __init__(
        self,
        profile: CostProfile,
        draft: ModelDrafter | None = None,
        n_max: int = 4,
        n_min: int = 1,
        k_max: int = 16,
        use_ngram: bool = True,
        disco=None,
        history: HistoryIndex | None = None,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        head: HeadDrafter | None = None,
        head_ms: float = 0.0,
        learn_head_ms: bool = False,
        learn_prices: bool = False,
        trees: bool = False,
    ) -> None:
        """disco: a trained DISCO artifact (`adaspec disco tune`); its classifier then
        estimates each draft token's acceptance instead of the confidence buckets.
        history: the cross-request index to propose from and to teach (None: not used);
        eos_token_ids: where a request's output ends (what the history learns stops there);
        head: a draft head over the target's features (`draft/head.py`), `head_ms` what one
        of its steps costs on this machine (measured by the method that builds it);
        learn_head_ms: from then on, price it at what its steps take here, in the engine
        (where the target's call has just evicted the head's weights from the caches: about
        twice the step timed alone, on the 2-vCPU Xeon), drifting back to `head_ms` while
        no step is measured; learn_prices: price a step alone by the profile rescaled by
        what this method's calls of as many rows took here (`cost.live`), learned from
        every step priced alone (a seeded sampled request reads the profile as it is);
        trees: a greedy step drafting from the head proposes its chain with the head's next
        candidates beside its tokens where the profile pays for their rows (`_head_tree`;
        the engine then scores token trees)."""
        self.profile = profile
        self.disco = disco
        self.ngram = NgramDrafter(n_max=n_max, n_min=n_min) if use_ngram else None
        self.history = history
        self.eos_token_ids = set(eos_token_ids)
        self.memory = AutoMemory(head_ms)  # across requests (`learn_with`)
        self._run = 0  # emitted tokens in a row the history predicted
        self._prompt: list[int] = []
        self._context: list[int] | None = None  # the request's context at its last commit
        self._history_seen: Choice | None = None  # this step's history continuation
        self._ngram_seen: Choice | None = None  # this step's n-gram continuation, not proposed
        self.model = draft
        if draft is not None:
            self.backend = draft.backend  # the engine bounds the context by it
            if profile.draft is None:
                from adaspec.errors import InputError

                raise InputError("method auto with a draft model needs a cost profile that "
                                 "measured the draft (adaspec profile --draft ...)")
        self.head = head
        self.drafts_trees = trees and head is not None
        self.chains_when_constrained = True  # `_siblings`: no tree for a constrained request
        self.head_floor_ms = head_ms
        self.learn_head_ms = learn_head_ms
        self.learn_prices = learn_prices
        self._live = False  # this step's prices read `memory.call_scale` (`propose`)
        # (context, target time before) of a step priced alone, for `commit` to learn from
        self._timed: tuple[int, float] | None = None
        self.needs_features = head is not None  # the engine records the target's features
        self._req: RequestState | None = None  # the request of the step being proposed
        self.k_max = k_max
        self.choices = AutoStats()
        self._last: Choice | None = None
        self._model_started = False
        self._without_draft = [0, 0.0]  # tokens emitted, ms priced: steps alone, no draft model
        self._priced: tuple[int, float] | None = None  # (context, ms) of this step, counted there
        self._seat: Seat | None = None  # the batch this step is priced in (`propose`)
        self._peeked = False  # this step drew the head's first token (`_peek_head`)
        self._remaining = 0  # the request's budget left as of this step (`propose`)
        # a step's prices (`_prices`), by whether priced in a batch; None: no step
        self._memo: dict[bool, list[float]] | None = None
        self._base_memo: float | None = None  # a step's `_base` in a batch
        self._reset_estimates()

    def learn_with(self, other: Drafter) -> None:
        """Learn across requests together with `other` (the same method's drafter on another
        slot): share its memory. A seeded sampled request reads none of it (it drafts from
        neither the history nor the head, and prices the draft model by its own rate), so
        its output stays the same whatever the other slots serve."""
        if isinstance(other, AutoDrafter) and (other.head is None) == (self.head is None):
            self.memory = other.memory  # its head price too (each engine timed its own)

    def _reset_estimates(self) -> None:
        self.ngram_rates = {m: RateEstimate(p) for m, p in NGRAM_PRIORS.items()}
        self.draft_rates = [RateEstimate(_bucket_prior(i))
                            for i in range(len(CONFIDENCE_EDGES) + 1)]
        self.draft_overall = RateEstimate(DRAFT_PRIOR)  # this request's, from the fixed prior
        # from recent requests
        self.draft_learned = RateEstimate(self.memory.draft_memory.rate)
        # this request's head tokens: (accepted, what the cross-request rates expected)
        self._head_outcomes = [0.0, 0.0]
        self._peek_seen: tuple[int, int, int] | None = None  # (context, token, bucket)

    # --------------------------------------------------------------- lifecycle
    def begin(self, req: RequestState) -> None:
        prompt_ids = req.prompt_ids
        self.learn()  # the previous request is over
        self._reset_estimates()
        self.choices = AutoStats()
        self._last = None
        self._history_seen = None
        self._ngram_seen = None
        self._run = 0
        self._model_started = False
        self._without_draft = [0, 0.0]
        self._priced = None
        self._timed = None
        if self.ngram is not None:
            self.ngram.begin(req)
        if self.head is not None:
            self.head.begin(req)
        self._prompt_len = len(prompt_ids)
        self._prompt = list(prompt_ids)

    def learn(self) -> None:
        """Hand the last request (its prompt, and its output up to the first end-of-sequence
        token) to the history; once per request (`start` calls it, a server may too as soon
        as a request ends)."""
        context, self._context = self._context, None
        if self.history is None or context is None:
            return
        output = context[len(self._prompt):]
        for i, token in enumerate(output):
            if token in self.eos_token_ids:
                output = output[: i + 1]
                break
        self.history.add_request(self._prompt, output)

    def cut(self, req: RequestState, depth: int) -> None:
        if self._last is not None:
            self._last.tokens = self._last.tokens[:depth]
            self._last.buckets = self._last.buckets[:depth]

    def commit(self, req: RequestState, path: list[int]) -> None:
        context = self._context = req.context
        priced, self._priced = self._priced, None
        if priced is not None:
            self._without_draft[0] += len(context) - priced[0]
            self._without_draft[1] += priced[1]
        last, self._last = self._last, None
        timed, self._timed = self._timed, None
        if timed is not None:  # what the step's call took against its profile price
            rows = 1 + ((last.rows or len(last.tokens)) if last is not None else 0)
            self.memory.call_scale.observe(rows, 1000 * (req.stats.target_time - timed[1]),
                                           self.profile.target(rows, timed[0]))
        if last is not None and last.tokens:
            self._credit(last, last.accepted(path))
        peeked, self._peek_seen = self._peek_seen, None
        proposed = last is not None and last.kind == "head" and bool(last.tokens)
        if peeked is not None and not proposed and req.sampling.greedy \
                and len(context) > peeked[0]:
            # greedy: the peeked token was right iff the step emitted it there
            self._head_outcome(peeked[2], context[peeked[0]] == peeked[1])
        unproposed, self._ngram_seen = self._ngram_seen, None
        if unproposed is not None:
            trials, accepted = _shadow_outcome(unproposed, context)
            self.ngram_rates[min(unproposed.match, 4)].add(trials, accepted)
        seen, self._history_seen = self._history_seen, None
        if seen is not None:
            self._credit_history(seen, context)
        else:
            self._run = 0  # the history had nothing to say: no run
        if self.ngram is not None:
            self.ngram.commit(req, path)
        if self.model is not None and self._model_started:
            self.model.commit(req, path)
        if self.head is not None:
            self.head.commit(req, path)

    def _credit(self, choice: Choice, accepted: int) -> None:
        trials = min(accepted + 1, len(choice.tokens))
        if choice.kind == "ngram":
            self.ngram_rates[min(choice.match, 4)].add(trials, accepted)
        elif choice.kind == "history":
            self.memory.history_outcomes[0] += len(choice.tokens)
            self.memory.history_outcomes[1] += accepted
        elif choice.kind == "draft":
            for i, bucket in enumerate(choice.buckets[:trials]):
                self.draft_rates[bucket].add(1, int(i < accepted))
            self.draft_overall.add(trials, accepted)
            self.draft_learned.add(trials, accepted)
            self.memory.draft_memory.add(trials, accepted, window=DRAFT_MEMORY)
        elif choice.kind == "head":
            for i, bucket in enumerate(choice.buckets[:trials]):
                self._head_outcome(bucket, i < accepted)
                self.memory.head_rates[bucket].add(1, int(i < accepted), window=HEAD_WINDOW)
            self.memory.head_overall.add(trials, accepted, window=HEAD_WINDOW)

    def _head_outcome(self, bucket: int, right: bool) -> None:
        """Count one of this request's head tokens against what its bucket's cross-request
        rate expected (before that rate learns from it)."""
        self._head_outcomes[0] += int(right)
        self._head_outcomes[1] += self.memory.head_rates[bucket].rate

    def _credit_history(self, seen: Choice, context: list[int]) -> None:
        """Credit the history's continuation of this step, whether or not it was proposed,
        by the tokens the step emitted (`_shadow_outcome`; for a proposed continuation that
        is its verification's outcome: the token after an accepted prefix is the
        correction, never the proposed one)."""
        trials, accepted = _shadow_outcome(seen, context)
        for i, cell in enumerate(seen.buckets[:trials]):
            self.memory.history_rates[cell].add(1, int(i < accepted), window=HISTORY_WINDOW)
        self._run = self._run + accepted if accepted == trials else 0

    # ----------------------------------------------------------------- prices
    def _draft_rate(self, params: SamplingParams) -> float:
        """The draft's per-token acceptance this step is priced with: learned across requests,
        but for a seeded sampled request, whose proposals (hence the random numbers its
        verification draws) must not depend on what the engine served before."""
        if not params.greedy and params.seed is not None:
            return self.draft_overall.rate
        return self.draft_learned.rate

    def _head_scale(self) -> float:
        """This request's own head outcomes against the cross-request rates
        (`HEAD_REQUEST_WEIGHT`)."""
        accepted, expected = self._head_outcomes
        return (accepted + HEAD_REQUEST_WEIGHT) / (expected + HEAD_REQUEST_WEIGHT)

    def _head_rate(self, bucket: int | None) -> float:
        """A head token's acceptance as this request prices it: its confidence bucket's rate
        across requests (None: the head's overall rate, a later token's before it is
        drafted) scaled by the request's own outcomes."""
        mem = self.memory
        rate = (mem.head_overall if bucket is None else mem.head_rates[bucket]).rate
        return min(0.99, rate * self._head_scale())

    def _in_batch(self) -> Seat | None:
        """The seat this step is priced in, where the round's call carries more than this
        request (else None: priced as a request alone)."""
        seat = self._seat
        return seat if seat is not None and seat.load.shared else None

    def _verify_ms(self, drafted: int, context: int) -> float:
        """ms of the target call that verifies `drafted` tokens: this request's own, or, in a
        batch, the round's call with them added (`cost.batch.BatchLoad`)."""
        return self._prices(drafted, context)[drafted]

    def _prices(self, upto: int, context: int) -> list[float]:
        """`_verify_ms` of 0..upto drafted tokens (at least), as this step is priced: read
        once a step (a step asks for each up to five times: plain, each free option alone
        and in the batch, the draft's lengths; at 16 clients that made `auto` 0.35 ms a step
        slower than `ngram:k=4`)."""
        seat = self._in_batch()
        key = seat is not None
        prices = self._memo.get(key) if self._memo is not None else None
        if prices is None:
            prices = []
            if self._memo is not None:
                self._memo[key] = prices
        if len(prices) > upto:
            return prices
        over = self.profile.overhead_ms
        if seat is not None:
            prices += [seat.load.call_ms(n) + over for n in range(len(prices), upto + 1)]
        else:  # a forward of n + 1 tokens verifies n
            row, live = self.profile.target.row(upto + 1, context), self.memory.call_scale
            prices += [row[n] * (live.scale(n + 1) if self._live else 1.0) + over
                       for n in range(len(prices), upto + 1)]
        return prices

    def _base(self, context: int) -> float:
        """Tokens a step is worth without this request's draft: alone, its own one; in a
        batch, the round's time in tokens of this request (`BatchLoad.token_ms`), so that a
        drafted token raises the rate exactly where the batch's work ends sooner by more
        than the token adds to the call."""
        seat = self._in_batch()
        if seat is None:
            return 1.0
        if self._base_memo is not None:
            return self._base_memo
        worth = seat.token_ms(self._remaining)
        base = self._verify_ms(0, context) / worth if worth > 0 else float("inf")
        if self._memo is not None:
            self._base_memo = base
        return base

    def _off_the_end(self, context: int) -> bool:
        """Whether this step is priced in a batch whose end does not wait on this request
        (`BatchLoad.token_ms` 0: its tokens shorten nothing). Then a plain step and every
        draft are worth the same (`_base` is infinite), so none is priced: at 16 clients
        most steps are such, and pricing them made `auto`'s server use 0.3-0.4 CPU seconds
        a wave more than `ngram:k=4`'s (2-vCPU Xeon, session 29), time every request of
        the round waits for."""
        return self._in_batch() is not None and math.isinf(self._base(context))

    def _best_length(self, rate: float, limit: int, fixed_ms: float, per_token_ms: float,
                     context: int, per_emitted_ms: float = 0.0) -> tuple[int, float]:
        """The length n <= limit with the most expected tokens per ms for a geometric
        per-token acceptance `rate`, each step costing `fixed_ms`, `per_token_ms` a drafted
        token and `per_emitted_ms` an expected emitted one; (n, tokens per ms). n = 0 is a
        plain step."""
        n, tokens, ms = self._chain_length(rate, rate, limit, fixed_ms, per_token_ms, context,
                                           per_emitted_ms)
        return n, tokens / ms

    def _chain_length(self, first: float, later: float, limit: int, fixed_ms: float,
                      per_token_ms: float, context: int, per_emitted_ms: float = 0.0
                      ) -> tuple[int, float, float]:
        """`_best_length` with the first token accepted with probability `first` and each
        later one with `later`; (n, expected tokens, ms)."""
        base = self._base(context)
        prices = self._prices(limit, context)
        best = (0, base, prices[0])
        value, p = base, 1.0
        for n in range(1, limit + 1):
            p *= first if n == 1 else later
            value += p
            cost = fixed_ms + per_token_ms * n + prices[n] + per_emitted_ms * value
            if value / cost > best[1] / best[2]:
                best = (n, value, cost)
        return best

    def _best_prefix(self, accept: list[float], context: int) -> tuple[int, float]:
        """The prefix length with the most expected tokens per ms, given each token's
        estimated acceptance (drafting it costs nothing); (n, tokens per ms)."""
        base = self._base(context)
        prices = self._prices(len(accept), context)
        best = (0, base / prices[0])
        value, p = base, 1.0
        for n, a in enumerate(accept, 1):
            p *= a
            value += p
            rate = value / prices[n]
            if rate > best[1]:
                best = (n, rate)
        return best

    def _free_option(self, accept: list[float], context: int) -> tuple[float, int]:
        """A draft that costs nothing to make (n-gram, history): its value as this step is
        priced, and how many of its tokens to propose. In a batch that is as many as a
        request alone would verify: the batch cuts them to what pays over the whole batch
        (`engine/batch.choose_lengths`), and reads from them the tokens a step of this request
        could make (its pace, which decides whether the batch's end waits on it)."""
        if self._off_the_end(context):
            value, n = math.inf, 0  # every option is worth the same: only `alone` counts
        else:
            n, value = self._best_prefix(accept, context)
        seat = self._seat
        if self._in_batch() is None:
            return value, n
        self._seat = None
        try:
            alone, _ = self._best_prefix(accept, context)
        finally:
            self._seat = seat
        return value, alone

    def _catch_up_ms(self, context: list[int]) -> tuple[float, float]:
        """What a draft-model step costs beyond its single-token forwards, as (ms a step,
        ms per token the request emits from here): once the draft has started, the first
        forward's extra tokens (those accepted since its last step), a step's; before, its
        prompt prefill, which serves every later draft step of the request.

        Alone, the prefill is spread over the tokens the request is still expected to emit
        (`_tokens_left`): a step that starts the draft then competes at its tokens per ms
        with the prefill's share of each token added, which is how the rest of the request
        compares with and without it. In a batch the prefill holds up every request, and
        what the later steps are worth moves as requests come and go (a request that just
        joined outlasts the others until the next one joins), so it is charged to this step
        whole: in the 8-client sweep, prefills started on that worth made the draft model
        1.8-4.2 s of a 48-58 s wave, outside the target's calls, for no fewer calls'
        time."""
        assert self.model is not None
        if not self._model_started:
            rate = self.profile.draft_prefill_tokens_per_s or 1000.0
            fresh = len(context) - self.model.reusable(context)
            prefill = 1000 * fresh / rate
            if self._in_batch() is not None:
                return prefill, 0.0
            return 0.0, prefill / self._tokens_left(context)
        pending = max(1, len(context) - self.model.cached_len)
        extra = (self.profile.draft_ms(pending, len(context))
                 - self.profile.draft_ms(1, len(context)))
        return extra, 0.0

    def _tokens_left(self, context: list[int]) -> int:
        """Tokens the request is taken to emit still: as many as it has produced (so a short
        answer, a translation of one sentence, never pays a prefill it cannot win back),
        within its budget left (`remaining`, where the engine said it), at least one.
        (Spread over as many draft steps as tokens produced instead, a prefill was priced
        at a third of its share or less: on a 2-vCPU Xeon the draft then started 19 tokens
        into HumanEval/1 and took 1.2 s of the request's 5.5 s, for 7 fewer target calls;
        4.1 s without it.)"""
        left = len(context) - self._prompt_len
        if self._remaining > 0:
            left = min(left, self._remaining)
        return max(1, left)

    def _rate_without_draft(self) -> float | None:
        """Tokens per ms this request's steps alone made before the draft model started, as
        they were priced (None: too few tokens to tell). Starting the draft pays only where
        its steps, prefill included, beat that rate over the rest of the request: priced
        against the step at hand instead, a draft started at a step with no n-gram match
        (where the alternative is a plain step) outbid the n-gram steps that would have
        come. On a 2-vCPU Xeon (draft 35 ms a token, target 80) it then started on a
        code-editing prompt the n-gram steps served at 1.9 tokens a call, and took
        9.2-9.7 s against 7.5-9.0 s without it (five runs each)."""
        tokens, ms = self._without_draft
        return tokens / ms if tokens >= RATE_EVIDENCE and ms > 0 else None

    # ---------------------------------------------------------------- propose
    def propose(self, req: RequestState, max_tokens: int,
                controller: LengthController) -> Proposal:
        self._memo = {}  # the step's context, seat and load are set from here on
        self._base_memo = None
        self._remaining = req.remaining
        self._req = req
        self._peeked = False
        params = req.sampling
        # a seeded sampled request's proposals (hence its draws) never depend on a timing
        self._live = self.learn_prices and (params.greedy or params.seed is None)
        try:
            proposal = self._propose(req.context, max_tokens, req.sampling, req.generator,
                                     req.seat)
            self._timed = ((len(req.context), req.stats.target_time)
                           if self._live and self._in_batch() is None else None)
            if self._peeked and not proposal.head_calls:  # a peek that lost: its step spent
                proposal = replace(proposal, head_calls=1)
            return proposal
        finally:
            self._memo = self._base_memo = None
            self._req = None

    def _propose(self, context: list[int], max_tokens: int, params: SamplingParams,
                 generator: torch.Generator | None, seat: Seat | None) -> Proposal:
        limit = min(max_tokens, self.k_max)
        ctx = len(context)
        # A seeded sampled request is priced as alone: its proposals (hence the random
        # numbers its verification draws) must not depend on its companions in a batch.
        self._seat = seat if params.greedy or params.seed is None else None
        options: list[tuple[float, str, int]] = [(self._base(ctx) / self._verify_ms(0, ctx),
                                                  "plain", 0)]
        ngram_tokens: list[int] = []
        match = 0
        if self.ngram is not None and limit > 0:
            ngram_tokens, match = self.ngram.lookup_with_match(context, limit)
            if ngram_tokens:
                rate = self.ngram_rates[min(match, 4)].rate
                value, n = self._free_option([rate] * len(ngram_tokens), ctx)
                options.append((value, "ngram", n))
        history_tokens: list[int] = []
        cells: list[tuple[int, int, int]] = []
        # A seeded sampled request stays reproducible: its proposals (hence the random
        # numbers its verification draws) must not depend on what earlier requests taught.
        if self.history is not None and limit > 0 and (params.greedy or params.seed is None):
            found = self.history.lookup(context, limit)
            if found.tokens:
                history_tokens = found.tokens
                cells = [history_cell(o, c, self._run + i) for i, (o, c) in
                         enumerate(zip(found.orders, found.confidence, strict=True))]
                rates = self.memory.history_rates
                value, n = self._free_option([rates[c].rate for c in cells], ctx)
                options.append((value, "history", n))
                self._history_seen = Choice("history", history_tokens, ctx, buckets=cells)
        # a step alone before the draft model starts: priced for the rate without it
        before_draft = not self._model_started and self._in_batch() is None
        if self.model is not None and limit > 0 and not self._off_the_end(ctx):
            d1 = self.profile.draft_ms(1, ctx)
            fixed, per_emitted = self._catch_up_ms(context)
            n, value = self._best_length(self._draft_rate(params), limit, fixed, d1, ctx,
                                         per_emitted)
            without = self._rate_without_draft() if before_draft else None
            if without is None or value > without:
                options.append((value, "draft", n))
        peek: _Peek | None = None
        # A seeded sampled request never drafts from the head: whether it pays is read off a
        # measured time, and its draws must not depend on one.
        if self.head is not None and limit > 0 and not self._off_the_end(ctx) \
                and (params.greedy or params.seed is None):
            peek = self._peek_head(options, limit, ctx, params, generator)
            self._peeked = peek is not None
            if peek is not None:
                options.append((peek.value, "head", peek.n))
        value, kind, n = max(options, key=lambda o: o[0])
        free = [o for o in options if o[1] in ("ngram", "history") and o[2] > 0]
        if kind == "plain" and free and self._in_batch() is not None:
            value, kind, n = max(free, key=lambda o: o[0])  # the batch decides (`_free_option`)
        if before_draft and kind != "draft":
            self._priced = (ctx, self._verify_ms(n, ctx))  # plain: n is 0
        if ngram_tokens and (kind != "ngram" or n == 0):  # credited by what the step emits
            self._ngram_seen = Choice("ngram", ngram_tokens, ctx, match=match)  # (`commit`)
        if kind == "plain" or n == 0:
            self.choices.plain += 1
            self._last = None
            return Proposal.chain(context[-1], [])
        if kind == "ngram":
            self.choices.ngram += 1
            tokens = ngram_tokens[:n]
            self._last = Choice("ngram", tokens, ctx, match=match)
            rate = self.ngram_rates[min(match, 4)].rate
            return Proposal.chain(context[-1], tokens, drafted_by={"ngram": n},
                                  accept=[rate] * n)
        if kind == "history":
            self.choices.history += 1
            tokens = history_tokens[:n]
            self._last = Choice("history", tokens, ctx, buckets=cells[:n])
            return Proposal.chain(context[-1], tokens, drafted_by={"history": n},
                                  accept=[self.memory.history_rates[c].rate for c in cells[:n]])
        if kind == "head":
            assert peek is not None
            self.choices.head += 1
            return self._draft_head(peek, context, limit, params, generator)
        self.choices.draft += 1
        return self._draft(context, limit, params, generator)

    def _peek_head(self, options: list[tuple[float, str, int]], limit: int, ctx: int,
                   params: SamplingParams, generator: torch.Generator | None) -> _Peek | None:
        """The head's first token, drawn only where it could win: a head step costs a few
        percent of a target step, so its first token is drafted (and that cost sunk) when,
        at the best rate any confidence bucket has shown, drafting would beat every other
        option; its own bucket's rate then prices the step. None: no head step this time."""
        assert self.head is not None and self._req is not None
        if not self._peek_pays(max(o[0] for o in options), limit, ctx):
            if self.learn_head_ms:  # unmeasured, the price drifts back to the step alone's,
                # so a price a slow minute raised gets measured again
                mem = self.memory
                mem.head_ms += (self.head_floor_ms - mem.head_ms) / (4 * HEAD_MS_WINDOW)
            return None
        t0 = clock()
        chain = self.head.open(self._req)
        if chain is None:  # the target gave no feature of the newest position
            return None
        token, processed, bucket, siblings = _head_token(chain, params, generator,
                                                         self._siblings(params))
        if self.learn_head_ms:  # a running mean over about the last HEAD_MS_WINDOW steps
            seen = 1000 * (clock() - t0)
            self.memory.head_ms += (seen - self.memory.head_ms) / HEAD_MS_WINDOW
        self.memory.head_seen[bucket] += 1
        total = sum(self.memory.head_seen)
        if total > HEAD_WINDOW:
            self.memory.head_seen = [c * HEAD_WINDOW / total for c in self.memory.head_seen]
        self._peek_seen = (ctx, token, bucket)  # credited in `commit` unless proposed
        n, tokens, ms = self._head_length(self._head_rate(bucket), self._head_rate(None),
                                          limit, ctx)
        return _Peek(chain, token, processed, bucket, n, tokens / ms, siblings)

    def _peek_pays(self, best: float, limit: int, ctx: int) -> bool:
        """Whether drawing the head's first token is worth its step: the head step is spent
        whatever its confidence shows, and pays only through the steps where that
        confidence makes the head beat `best` (tokens per ms of the best other option,
        taken at a plain step's time). Weighed by how often peeks have landed in each
        confidence bucket (across requests): peeking every step at a head that seldom wins
        cost 13% of a step on translations (session 32)."""
        plain_ms = self._verify_ms(0, ctx)
        other = (best * plain_ms, plain_ms)  # (tokens, ms) of not drafting from the head
        total = sum(self.memory.head_seen)
        tokens = ms = 0.0
        later = self._head_rate(None)
        for bucket, seen in enumerate(self.memory.head_seen):
            n, t, m = self._head_length(self._head_rate(bucket), later, limit, ctx)
            t, m = (t, m) if n > 0 and t / m > best else other
            tokens += seen / total * t
            ms += seen / total * m
        return tokens / (ms + self.memory.head_ms) > best

    def _head_length(self, first: float, later: float, limit: int, ctx: int
                     ) -> tuple[int, float, float]:
        """The head chain's best length, its expected tokens and its ms, its first token
        drafted already (its cost sunk)."""
        ms = self.memory.head_ms
        return self._chain_length(first, later, limit, -ms, ms, ctx)

    def _draft_head(self, peek: _Peek, context: list[int], limit: int, params: SamplingParams,
                    generator: torch.Generator | None) -> Proposal:
        """Head tokens from the peeked first one until no look-ahead of a few more tokens
        pays, as for the draft model (`_draft`), each token's acceptance read from its
        confidence bucket."""
        chain = peek.chain
        ctx = len(context)
        d1 = self.memory.head_ms
        step_ms = [n * d1 + ms for n, ms in enumerate(self._prices(limit, ctx)[: limit + 1])]
        base = self._base(ctx)
        a_next = self._head_rate(None)
        tokens = [peek.token]
        rows = [peek.probs] if peek.probs is not None else []
        buckets = [peek.bucket]
        accept = [self._head_rate(peek.bucket)]
        siblings = [peek.siblings]
        while len(tokens) < limit and cost_keeps_drafting(accept, a_next, step_ms, limit, base):
            chain.advance(tokens[-1])
            token, processed, bucket, others = _head_token(chain, params, generator,
                                                           self._siblings(params))
            if processed is not None:
                rows.append(processed)
            tokens.append(token)
            buckets.append(bucket)
            accept.append(self._head_rate(bucket))
            siblings.append(others)
        # the peek's step is sunk
        spent = (chain.steps - 1) * d1
        if self._siblings(params):
            tree = self._head_tree(context, tokens, buckets, accept, siblings, spent,
                                   chain.steps)
            if tree is not None:
                return tree
        return self._verified_prefix("head", context, tokens, rows, buckets, accept, spent,
                                     chain.steps)

    def _siblings(self, params: SamplingParams) -> int:
        """Candidates a head token's level offers beside it: trees at temperature 0 only,
        and never for a constrained request (verified on chains)."""
        constrained = self._req is not None and self._req.constraint is not None
        return TREE_SIBLINGS if self.drafts_trees and params.greedy and not constrained else 0

    def _head_tree(self, context: list[int], tokens: list[int], buckets: list[int],
                   accept: list[float], siblings: list[Candidates], spent: float,
                   calls: int) -> Proposal | None:
        """The head's chain with its next candidates beside its tokens, the nodes kept best
        first by the chance their path is accepted while the step's expected tokens per ms
        rise (`best_counts`): the chain's tokens at their confidence buckets' rates, a
        sibling at the head's probability of it scaled as this request's head tokens held
        (the head is calibrated: experiments/results/head-calibration-xeon-amx). None where
        that keeps no sibling: the chain's best prefix is the step (`_verified_prefix`)."""
        assert self._req is not None
        ctx = len(context)
        room = self._req.tree_nodes  # what the target's cache holds as one tree this step
        most = min(TREE_NODES, room - 1 if room is not None else TREE_NODES)
        scale = self._head_scale()
        levels = [[a, *(min(0.99, q * scale) for q in probs)]
                  for a, (_, probs) in zip(accept, siblings, strict=True)]
        counts = best_counts(levels, lambda n: spent + self._verify_ms(n, ctx), most,
                             self._base(ctx))
        if max(counts, default=0) <= 1:
            return None
        tree, firsts = level_tree(context[-1], [[t, *others] for t, (others, _) in
                                                zip(tokens, siblings, strict=True)], counts)
        depth = len(firsts)
        nodes = len(tree) - 1
        self._last = Choice("head", tokens[:depth], ctx, buckets=buckets[:depth],
                            nodes=firsts, rows=nodes)
        return Proposal(tree, None, head_calls=calls, drafted_by={"head": nodes})

    def _accept_estimate(self, features: list[float], bucket: int, position: int,
                         context: int) -> float:
        """P(this draft token is accepted): the DISCO classifier's on the token's
        distribution features, when one is given, else the running rate of its confidence
        bucket."""
        if self.disco is None:
            return self.draft_rates[bucket].rate
        from adaspec.control.disco_features import assemble

        x = assemble(torch.tensor(features, dtype=torch.float32), position,
                     context - self._prompt_len + position, self.disco.spec)
        return float(self.disco.classifier.accept_probability(x))

    def _draft(
        self,
        context: list[int],
        limit: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        """Draft model tokens until no look-ahead of a few more tokens pays
        (`cost.rule.cost_keeps_drafting`)."""
        from adaspec.control.disco_features import distribution_features

        model = self.model
        assert model is not None
        ctx = len(context)
        if not self._model_started:
            model.prefill(context)
            self._model_started = True
        pending = model.pending(context)
        d1 = self.profile.draft_ms(1, ctx)
        a_next = self._draft_rate(params)
        # step_ms[n]: n draft forwards and a verification of n tokens
        step_ms = [n * d1 + ms for n, ms in enumerate(self._prices(limit, ctx)[: limit + 1])]
        base = self._base(ctx)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        buckets: list[int] = []
        accept: list[float] = []  # each drafted token's estimated acceptance
        calls = 0
        while len(tokens) < limit:
            logits = model.step(pending)  # where the draft ran
            calls += 1
            drawn, processed = draw(logits, params, generator)
            if processed is not None:
                rows.append(processed)
            # the token, its confidence and (with a classifier) its features: one read
            numbers = [drawn.double(), torch.softmax(logits.float(), dim=-1).max().reshape(1)
                       .double()]
            if self.disco is not None:
                numbers.append(distribution_features(logits).double())
            read = torch.cat(numbers).tolist()
            token, bucket = int(read[0]), _bucket_of(read[1])
            tokens.append(token)
            buckets.append(bucket)
            accept.append(self._accept_estimate(read[2:], bucket, len(tokens) - 1, ctx))
            pending = [token]
            if not cost_keeps_drafting(accept, a_next, step_ms, limit, base):
                break
        return self._verified_prefix("draft", context, tokens, rows, buckets, accept,
                                     len(tokens) * d1, calls)

    def _verified_prefix(self, kind: str, context: list[int], tokens: list[int],
                         rows: list[torch.Tensor], buckets: list[int], accept: list[float],
                         spent: float, calls: int) -> Proposal:
        """The drafted prefix with the best expected tokens per ms, drafting's `spent` ms
        paid either way, as this step's proposal (`kind`: draft | head)."""
        ctx = len(context)
        values = [self._base(ctx)]  # expected tokens if the first i drafted tokens are verified
        for p in accumulate(accept, operator.mul):
            values.append(values[-1] + p)
        best = max(range(len(tokens) + 1),
                   key=lambda j: values[j] / (spent + self._verify_ms(j, ctx)))
        tokens, buckets = tokens[:best], buckets[:best]
        self._last = Choice(kind, tokens, ctx, buckets=buckets)
        head = kind == "head"
        return Proposal.chain(
            context[-1], tokens, torch.stack(rows[:best]) if rows and best else None,
            0 if head else calls, drafted_by={kind: best} if best else None,
            accept=accept[:best], head_calls=calls if head else 0,
        )
