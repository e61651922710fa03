"""Latency of a speculation-length policy, simulated on collected greedy outputs.

A policy drafts from position p, asks after each drafted token whether to go on (a score
against a threshold), stops at SL_max, and the target verifies. Under greedy decoding the
accepted count is the run of teacher-forced hits at the start of the draft, so the target
calls, draft calls and tokens per step follow from the hits alone; the time follows from
per-forward costs measured on this machine (`measure_costs`) or read from a cost profile
(`Costs.from_profile`, the one source every cost-aware decision prices with): drafted x draft
forward + one target forward of drafted + 1 tokens (+ the loop's overhead per step and the
controller's own cost per decision).

Two stop rules are simulated on DISCO's scores: the threshold (`stop="tau"`) and the cost rule
(`stop="cost"`, `cost.rule.cost_keeps_drafting`), which prices one more token with these
same costs.

What is simulated, not measured: after the draft's first wrong token the real draft conditions
on that wrong token, but the simulation reads the teacher-forced features of the true
prefix there (they only decide how many wasted tokens follow a miss); the per-step bookkeeping
outside the two forwards is left out (but for a profile's measured overhead_ms). Real runs
(`adaspec disco tune --confirm`, the bench) check the chosen settings.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from adaspec.backends.base import ModelBackend
from adaspec.cost.profile import CostProfile
from adaspec.cost.rule import cost_keeps_drafting
from adaspec.errors import InputError

DEFAULT_SL_MAXES = tuple(range(1, 9))  # the static k = 1..8
ORACLE_CAP = max(DEFAULT_SL_MAXES)  # the oracle drafts at most as much as any tuned setting


NEVER_STOP = -1.0  # a threshold no score falls below: the static schedule


@dataclass
class Costs:
    """Milliseconds per forward: draft_ms for one token, target_ms[n - 1] for n tokens (a
    verification of n - 1 drafted tokens), decision_ms per controller decision, overhead_ms
    per step (the loop's own time; 0 when timed by `measure_costs`, which times forwards).
    Timed while tuning (source "measured") or read from a cost profile (`from_profile`);
    the dict form is what artifacts store under tuning["costs"] (older ones lack the last
    three fields, which default to a measurement)."""

    draft_ms: float
    target_ms: list[float]
    decision_ms: float = 0.0
    context_tokens: int = 0
    repeats: int = 0
    overhead_ms: float = 0.0
    source: str = "measured"
    simulated: bool = False

    @classmethod
    def from_profile(
        cls, profile: CostProfile, max_tokens: int, context: int | None = None
    ) -> Costs:
        """The profile's prices for steps of up to `max_tokens` drafted tokens (target
        forwards of 1..max_tokens + 1 tokens) at `context` cached tokens (None: the
        profile's first measured context)."""
        if max_tokens < 1:
            raise InputError("Costs.from_profile needs max_tokens >= 1")
        if profile.draft is None:
            raise InputError("pricing draft steps needs a cost profile that measured the draft")
        return cls(
            draft_ms=profile.draft_ms(1, context),
            target_ms=[profile.target_ms(n, context) for n in range(1, max_tokens + 2)],
            context_tokens=context or 0,
            overhead_ms=profile.overhead_ms,
            source=f"profile:{profile.source}",
            simulated=profile.simulated,
        )

    def target(self, n: int) -> float:
        if n > len(self.target_ms):
            raise InputError(f"no measured target cost for {n} tokens (max {len(self.target_ms)})")
        return self.target_ms[n - 1]

    def step_ms(self, drafted: int) -> float:
        """One speculation step: `drafted` draft forwards, then one verification."""
        return drafted * self.draft_ms + self.target(drafted + 1) + self.overhead_ms

    def to_dict(self) -> dict:
        return asdict(self)


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


@torch.inference_mode()
def measure_costs(
    target: ModelBackend,
    draft: ModelBackend,
    context: list[int],
    max_tokens: int,
    repeats: int = 5,
    decision=None,
) -> Costs:
    """Time the forwards a step costs, after `context` is cached: the draft on 1 token, the
    target on 1..max_tokens+1 tokens (cache rolled back after each), and one `decision`
    (a callable: the controller's per-token work) if given. The sizes are timed in rounds,
    target and draft interleaved, so a burst of other work on the machine lands on one round
    of every size rather than on all rounds of one; medians over `repeats` rounds, after a
    warm-up round."""
    if repeats < 1 or max_tokens < 1 or not context:
        raise InputError("measure_costs needs a context, max_tokens >= 1 and repeats >= 1")
    target.prefill(torch.tensor(context))
    draft.prefill(torch.tensor(context))
    sizes = [("target", n) for n in range(1, max_tokens + 2)] + [("draft", 1)]
    times: dict[tuple[str, int], list[float]] = {s: [] for s in sizes}
    for round_ in range(repeats + 1):  # round 0 warms up
        for role, n in sizes:
            backend = target if role == "target" else draft
            base = backend.cache_len
            tokens = torch.tensor(context[-1:] * n)
            t0 = time.perf_counter()
            backend.forward(tokens)
            elapsed = 1000 * (time.perf_counter() - t0)
            backend.truncate(base)
            if round_:
                times[(role, n)].append(elapsed)
    target.reset()
    draft.reset()
    decision_ms = 0.0
    if decision is not None:
        decision()
        decision_ms = _median_ms(decision, max(repeats, 20))
    return Costs(
        draft_ms=statistics.median(times[("draft", 1)]),
        target_ms=[statistics.median(times[("target", n)]) for n in range(1, max_tokens + 2)],
        decision_ms=decision_ms,
        context_tokens=len(context),
        repeats=repeats,
    )


@dataclass
class SimResult:
    tokens: int = 0  # tokens decoded after the prefill's first one
    time_ms: float = 0.0
    target_calls: int = 0
    draft_calls: int = 0
    accepted: int = 0

    def add_step(self, costs: Costs, drafted: int, accepted: int, decide: bool = False) -> None:
        """Account one step: its time (+ one decision per drafted token), calls and tokens."""
        self.time_ms += costs.step_ms(drafted) + (drafted * costs.decision_ms if decide else 0.0)
        self.target_calls += 1
        self.draft_calls += drafted
        self.accepted += accepted
        self.tokens += accepted + 1

    def add(self, other: SimResult) -> None:
        for k in ("tokens", "time_ms", "target_calls", "draft_calls", "accepted"):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    @property
    def ms_per_token(self) -> float:
        return self.time_ms / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "ms_per_token": self.ms_per_token}


HitTable = Sequence[bool] | Sequence[Sequence[bool]]


def hit_reader(hits: HitTable) -> Callable[[int, int], bool]:
    """hit(i, d): whether token i drafted at draft position d is the target's. Hits [n] are
    the same at every position (a model draft); hits [n][D] differ by position (a draft
    head feeding its own states back)."""
    if len(hits) and isinstance(hits[0], Sequence):
        table = [[bool(x) for x in row] for row in hits]  # type: ignore[union-attr]
        return lambda i, d: table[i][d]
    flat = [bool(x) for x in hits]
    return lambda i, d: flat[i]


def simulate(
    hits: HitTable,
    scores: torch.Tensor | None,
    tau: float,
    sl_max: int,
    costs: Costs,
    oracle: bool = False,
    stop: str = "tau",
    guess: str = "last",
) -> SimResult:
    """One greedy generation of len(hits) tokens under a policy (hits as `hit_reader`'s).

    scores[i, d]: the policy's score for token i drafted at position d of the current draft
    (DISCO's acceptance probability; the top draft probability for the confidence rule);
    None (or tau = NEVER_STOP with stop="tau") for a static length. stop="cost" runs DISCO's
    cost rule on the scores instead of the threshold (tau unused; `guess` as the
    controller's). oracle=True drafts exactly the run of hits (up to sl_max), as
    `control.oracle.OracleLength` does."""
    if hits and isinstance(hits[0], Sequence) and sl_max > len(hits[0]):
        raise InputError(f"the hits describe drafts of up to {len(hits[0])} tokens, not "
                         f"SL_max {sl_max}")
    hit = hit_reader(hits)
    sc = scores.tolist() if scores is not None else None  # Python floats: fast to index
    n = len(hits)
    res = SimResult()
    p = 1  # token 0 comes from the prefill
    cost_rule = stop == "cost"
    decide = scores is not None and (cost_rule or tau > NEVER_STOP) and not oracle
    if decide and scores is not None and scores.shape[1] < sl_max:  # (decide: scores given)
        raise InputError(f"scores cover {scores.shape[1]} draft positions, sl_max is {sl_max}")
    prices = [costs.step_ms(d) for d in range(sl_max + 1)] if decide and cost_rule else []
    seen, count = 0.0, 0  # the generation's scores so far, for guess="mean"
    while p < n:
        limit = min(sl_max, n - p - 1)  # the engine never drafts past the token budget
        if oracle:
            drafted = 0
            while drafted < limit and hit(p + drafted, drafted):
                drafted += 1
        else:
            drafted = 0
            step: list[float] = []
            while drafted < limit:
                drafted += 1
                if not decide:
                    continue
                s = sc[p + drafted - 1][drafted - 1]  # type: ignore[index]  # why: decide: sc set
                if not cost_rule:
                    if s < tau:
                        break
                    continue
                step.append(s)
                seen += s
                count += 1
                g = s if guess == "last" else seen / count
                if not cost_keeps_drafting(step, g, prices, sl_max):
                    break
        accepted = 0
        while accepted < drafted and hit(p + accepted, accepted):
            accepted += 1
        res.add_step(costs, drafted, accepted, decide)
        p += accepted + 1
    return res


def simulate_all(
    hits_list: Sequence[HitTable],
    scores_list: Sequence[torch.Tensor | None],
    tau: float,
    sl_max: int,
    costs: Costs,
    oracle: bool = False,
    stop: str = "tau",
    guess: str = "last",
) -> SimResult:
    total = SimResult()
    for hits, scores in zip(hits_list, scores_list, strict=True):
        total.add(simulate(hits, scores, tau, sl_max, costs, oracle, stop, guess))
    return total


def price_run(row: dict, costs: Costs, decides: bool = False) -> float | None:
    """A measured bench run's decode, priced: its own verification sizes and draft calls at
    the per-forward costs timed while tuning (+ one decision per drafted token when the
    controller `decides`), in ms. Free of the run's timing noise, so arms that made the same
    calls cost the same; blind to everything outside the two forwards (prefills included).
    None when the run verified more tokens at once than were timed (the heuristic schedule
    grows past SL_max)."""
    steps = row.get("steps") or []
    if any(int(d) + 1 > len(costs.target_ms) for d, _ in steps):
        return None
    turns = len(row.get("turn_tokens") or [1])
    single = row["target_calls"] - turns - len(steps)  # one-token target calls, no draft
    ms = sum(costs.target(int(d) + 1) for d, _ in steps) + single * costs.target(1)
    ms += row.get("draft_calls", 0) * costs.draft_ms + (len(steps) + single) * costs.overhead_ms
    if decides:
        ms += sum(int(d) for d, _ in steps) * costs.decision_ms
    return ms


def best_lengths(hits: Sequence[bool], costs: Costs, sl_max: int) -> list[tuple[int, int]]:
    """(drafted, accepted) of the fastest step starting at each position, the rest of the
    generation also run the fastest way (lengths 0..sl_max, chosen knowing the hits and the
    costs). Dynamic programming from the end over positions; index 0 (the prefill's token)
    is unused."""
    h = [bool(x) for x in hits]
    n = len(h)
    best: list[tuple[float, int, int]] = [(0.0, 0, 0)] * (n + 1)  # (ms to finish, d, a)
    for p in range(n - 1, 0, -1):
        options = []
        limit = min(sl_max, n - p - 1)
        run = 0
        for d in range(limit + 1):
            if d and run == d - 1 and h[p + d - 1]:
                run = d  # accepted = the hits at the start of a d-token draft
            nxt = min(p + run + 1, n)
            options.append((costs.step_ms(d) + best[nxt][0], d, run))
        best[p] = min(options)
    return [(d, a) for _, d, a in best[:n]]


def best_schedule(hits: Sequence[bool], costs: Costs, sl_max: int) -> SimResult:
    """The fastest any length policy can be on one generation: the floor under DISCO,
    static k and the oracle. The oracle drafts until the first miss, which over-drafts when
    a long verification costs more than the tokens it gains; this schedule weighs that."""
    steps = best_lengths(hits, costs, sl_max)
    res = SimResult()
    p = 1
    while p < len(steps):
        d, a = steps[p]
        res.add_step(costs, d, a)
        p += a + 1
    return res
