"""The batch dimension of the cost profile: what one target call costs when it carries the
tokens of several sequences (requests decoded together), by total tokens and by sequences.

Why: a call's time grows far slower than its tokens (on the 2-vCPU EPYC ik_llama.cpp scores
8 tokens for 3.75 single-token passes), and that slack is what both more requests and longer
drafts spend. `engine/batch.py` prices each step's drafts against it. Measured per machine
and runtime on first use, cached beside the cost profile.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

import torch

from adaspec.backends.base import ModelBackend
from adaspec.backends.sequences import ALL, forward_together
from adaspec.cost.profile import Curve
from adaspec.errors import InputError
from adaspec.store.atomic import write_json

SEQUENCES = [1, 2, 4, 8, 16, 32, 64]  # as many as the views given (a GPU's serve: 64)
PER_SEQUENCE = [1, 2, 4, 8]  # tokens each sequence feeds
# Drafted tokens on one sequence beside one token for each other: the shapes a batch verifies
# most. Not on the line between the uniform shapes: on a 2-vCPU Xeon the first drafted token
# in a call of eight added 31 ms (a sequence's row is 23), eight drafted tokens 98.
EXTRA = [1, 2, 4]
CONTEXT = 128  # cached tokens per sequence while timing
REPEATS = 8
FORMAT = 3  # 3: drafted-token shapes, read as paired ratios (2: fastest round; 1: medians)


# ms of one call by (total tokens, sequences)
BatchCostFn = Callable[[int, int], float]


@dataclass
class BatchLoad:
    """The round a batched request's draft joins, as its drafter and the batch price it: a
    draft of n tokens makes the round's call carry n more tokens, and its drafting time holds
    up every request of the round. What an accepted token is worth is the time the batch's
    work ends sooner by (`token_ms`), so a draft pays only where it shortens the batch, not
    only its own request. `engine/batch.BatchDecoder` keeps it current each round."""

    cost: BatchCostFn | None = None
    sequences: int = 1  # requests decoding together this round, the drafter's own included
    prompts: int = 0  # prompts being prefilled in chunks beside them (a sequence each)
    prompt_tokens: int = 0  # the prompt tokens the round's call is expected to carry
    budgets: list[int] = field(default_factory=list)  # every request's tokens left to emit
    paces: list[float] = field(default_factory=list)  # each one's tokens a step, drafting
    waiting: int = 0  # requests queued for a place in the batch
    _calls: dict = field(default_factory=dict, repr=False, compare=False)  # `call_ms`'s

    @property
    def shared(self) -> bool:
        """Whether the round's call carries more than this request (else: priced alone)."""
        return self.cost is not None and (self.sequences > 1 or self.prompt_tokens > 0)

    def call_ms(self, drafted: int) -> float:
        """ms of the round's call with `drafted` more tokens than one per request (every
        request of a round prices the same calls: read once a round)."""
        assert self.cost is not None
        key = (self.cost, self.sequences, self.prompt_tokens, self.prompts, drafted)
        ms = self._calls.get(key)
        if ms is None:
            if len(self._calls) > 4096:
                self._calls.clear()
            ms = self._calls[key] = self.cost(self.sequences + self.prompt_tokens + drafted,
                                              self.sequences + self.prompts)
        return ms

    def least_rounds(self) -> float:
        """Rounds the batch needs at the least: its slowest request's, each request making
        as many tokens a step as its drafts could (`paces`; 1 where not known)."""
        paces = self.paces + [1.0] * (len(self.budgets) - len(self.paces))
        return max((b / max(1.0, e) for b, e in zip(self.budgets, paces, strict=False)),
                   default=0.0)

    def token_ms(self, remaining: int, pace: float = 1.0) -> float:
        """ms by which the batch's work ends sooner when a request with `remaining` tokens
        left (and `pace`, its tokens a step drafting) emits one token more now.

        - With requests waiting, its place goes to the next one sooner: a token is worth
          the batch's time per token.
        - A request that would end the batch later than its slowest request must (more
          tokens left than `least_rounds`) is what the batch's end waits on, with the others
          so placed: its tokens are worth their share of a call of those requests, less
          as the call makes `pace` tokens of each (drafting as the batch's end allows).
          (At a whole share a token, such requests verified drafts in calls of five and
          six on a 2-vCPU Xeon, 4-6 tokens a call for 100-150 ms more: in process, an
          8-client closed loop's calls priced by the curve came to 55.6 s against 54.4
          without drafts; with the pace, 54.0.)
        - The request that outlasts all the others (none has as many tokens left) saves
          its steps at the end, where it runs alone and drafts as alone: a call of its own
          for every `pace` tokens. (Priced at a whole call a token, a request that had just
          joined, hence outlasted the rest until the next one joined, verified drafts in
          calls of eight: in the 8-client sweep 6% fewer rounds for 5% more calls' time.)
        - Any other ends while the batch goes on: an accepted token saves its row of a
          later call, about what the drafted row adds to this one, so with the rejected
          ones counted its drafts never pay (0). Priced by the curve's rows instead (a
          sequence's row 15 ms against a drafted token's 11.5 in a call of eight on a
          2-vCPU Xeon), such drafts were verified in most rounds, and a request the
          batch's end waited on took 270 ms a step against 180 without them."""
        assert self.cost is not None
        if self.waiting:
            s = max(1, len(self.budgets))
            return self.cost(s, s) / s
        least = self.least_rounds()
        pace = max(1.0, pace)
        if remaining > least:
            k = max(1, sum(1 for b in self.budgets if b > least))
            return self.cost(k, k) / k / pace
        if sum(1 for b in self.budgets if b >= remaining) <= 1:  # itself, or none known
            return self.cost(1, 1) / pace
        return 0.0


@dataclass
class Seat:
    """One request's place in a batch: the round it is priced in and its pace
    (`BatchDecoder.seat` makes it; the request's drafter reads it from its `RequestState`;
    `engine/batch.BatchDecoder` counts its steps)."""

    load: BatchLoad
    # its pace: tokens its steps would make if verified whole, over its steps (one plain
    # step as a prior)
    steps_seen: int = 1
    tokens_seen: float = 1.0

    @property
    def pace(self) -> float:
        """Its tokens a step, drafting."""
        return self.tokens_seen / self.steps_seen

    def token_ms(self, remaining: int) -> float:
        """What one more accepted token of this request, with `remaining` tokens left
        (`RequestState.remaining`), is worth, in ms of the batch."""
        return self.load.token_ms(remaining, self.pace)


@dataclass
class BatchCost:
    """ms of one call by total tokens (`curve.sizes`) and by sequences (`curve.contexts`:
    the curve's second axis counts sequences here)."""

    curve: Curve
    key: dict
    measured_s: float = 0.0
    others_share: float = 0.0  # of the machine's CPU, taken by other processes meanwhile

    def ms(self, tokens: int, sequences: int) -> float:
        return self.curve(tokens, sequences)

    def to_dict(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> BatchCost:
        if d.get("format") != FORMAT:
            raise InputError("not a batch cost file of this adaspec")
        return cls(Curve(**d["curve"]), dict(d.get("key", {})), float(d.get("measured_s", 0)),
                   float(d.get("others_share", 0.0)))

    def save(self, path: Path) -> Path:
        return write_json(path, self.to_dict(), indent=1)


def call_lengths(sequences: int, tokens: int) -> list[int]:
    """Tokens each sequence feeds in the timed call of `tokens` over `sequences`: as many
    each where they divide, else one token each and the rest on one sequence (a draft)."""
    if tokens % sequences == 0:
        return [tokens // sequences] * sequences
    return [1] * (sequences - 1) + [tokens - sequences + 1]


def settled_ms(plain: list[float], shape: list[float]) -> float:
    """A shape's cost from its rounds: the plain call's (one token a sequence) median times
    the median over rounds of the shape's time over the plain call's in the same round.
    A slow moment of the shared machine slows both calls of a round alike, so one shape
    caught in slow moments does not read dearer than the rest; the fastest round, which
    this replaces, read a call of eight with a drafted token at the plain call's time,
    where every other statistic read it 17% dearer (2-vCPU Xeon, session 22)."""
    return median(plain) * median(s / p for s, p in zip(shape, plain, strict=True))


def measure_batch_cost(
    views: Sequence[ModelBackend], key: dict, repeats: int = REPEATS,
    progress: Callable[[str], None] | None = None,
) -> BatchCost:
    """Time calls of s sequences x t tokens (s up to len(views)), each sequence after
    CONTEXT cached tokens, in rounds that interleave the shapes (`call_lengths`), after a
    warm-up round; each shape read against its round's plain call (`settled_ms`). The
    views' caches are left empty."""
    from adaspec.cost.measure import context_ids

    t_start = time.perf_counter()
    seqs = [s for s in SEQUENCES if s <= _most_sequences(len(views))]
    for i, view in enumerate(views[: seqs[-1]]):
        view.reset()
        view.forward(torch.tensor(context_ids(CONTEXT, view.vocab_size, seed=i)))
    totals = {s: sorted({s * t for t in PER_SEQUENCE} | {s + e for e in EXTRA}) for s in seqs}
    times: dict[tuple[int, int], list[float]] = {(s, n): [] for s in seqs for n in totals[s]}
    for round_ in range(repeats + 1):
        for s, n in times:  # each sequence count's plain call first, its other shapes next
            items = [(v, context_ids(t, v.vocab_size, seed=100 + j), ALL)
                     for j, (v, t) in enumerate(zip(views[:s], call_lengths(s, n), strict=True))]
            t0 = time.perf_counter()
            forward_together(items)
            ms = 1000 * (time.perf_counter() - t0)
            for v in views[:s]:
                v.truncate(CONTEXT)
            if round_:
                times[(s, n)].append(ms)
        if progress:
            progress(f"batch cost: round {round_ + 1}/{repeats + 1}")
    for view in views:
        view.reset()
    # one row per sequence count, over total tokens
    sizes = sorted({n for s, n in times})
    rows = []
    for s in seqs:
        points = {n: settled_ms(times[(s, s)], times[(s, n)]) for n in totals[s]}
        xs = sorted(points)
        row = []
        for n in sizes:  # read each row at every size: linear between its own points
            if n <= xs[0]:
                row.append(points[xs[0]] * (n / xs[0] if n < xs[0] else 1.0))
                continue
            j = next((i for i, x in enumerate(xs) if x >= n), len(xs) - 1)
            a, b = xs[j - 1], xs[j]
            row.append(max(1e-3, points[a] + (points[b] - points[a]) * (n - a) / (b - a)))
        rows.append(row)
    return BatchCost(Curve(sizes, seqs, rows), key, time.perf_counter() - t_start)


def _most_sequences(views: int) -> int:
    return max([s for s in SEQUENCES if s <= views] or [1])


def batch_cost_for(target: ModelBackend, views: Sequence[ModelBackend],
                   remeasure: bool = False) -> BatchCost:
    """This machine's batch cost of `target`'s runtime: read from the profiles folder, or
    measured now (about a minute with eight slots, said on stderr) and stored."""
    from adaspec.cost import other_load
    from adaspec.cost.cache import profile_key, profile_path

    key = {**profile_key(target, None), "batch": FORMAT}
    base = profile_path(key)
    path = base.with_name(base.stem + "-batch.json")

    def say(text: str) -> None:
        print(f"adaspec: {text}", file=sys.stderr, flush=True)

    if path.is_file() and not remeasure:
        try:
            import json

            cost = BatchCost.from_dict(json.loads(path.read_text()))
            # one for fewer sequences than these views is measured again, wider; one
            # measured on a busy machine too, once it is quiet
            if cost.key == key and cost.curve.contexts[-1] >= _most_sequences(len(views)):
                if not other_load.measure_again(cost.others_share):
                    return cost
                say(f"the stored batch cost was measured while other processes took "
                    f"{cost.others_share:.0%} of the CPU; the machine is quiet now")
        except (OSError, ValueError, KeyError, TypeError, InputError):
            pass  # unreadable: measure again

    say(f"measuring the batch cost of {target.name} ({target.kind}) on this machine, once")
    cost = other_load.measured(lambda: measure_batch_cost(views, key, progress=say),
                               "the batch cost", say)
    cost.save(path)
    say(f"batch cost measured in {cost.measured_s:.0f} s, saved to {path}")
    return cost
