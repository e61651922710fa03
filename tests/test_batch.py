"""Requests decoded together (engine/batch.py) on tiny models: each request's output is what
it gets decoded alone (greedy), follows the target's law (sampling, with a swapped-rows
negative control), reproduces whatever else is in the batch (seeded, with a
shared-generator negative control); the batch pricing cuts drafts without changing outputs;
one request's failure or cancellation leaves the others as they were."""

from __future__ import annotations

import pytest
import torch

from adaspec.backends.torch.backend import TorchBackend
from adaspec.core.metrics import RequestStats
from adaspec.core.request import RequestState
from adaspec.core.sampling import SamplingParams
from adaspec.engine import batch as batch_mod
from adaspec.engine.batch import BatchDecoder, choose_lengths
from adaspec.engine.steps import GenerationResult, StreamChunk
from adaspec.methods.build import build_generator

from .conftest import sampling_backend, tiny_model
from .stats_helpers import assert_caught, assert_exact
from .test_engine_sampling import PROMPT, V, check

PROMPTS = [[5, 9, 13, 2], [17, 3, 3, 3, 40, 41, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
           [33], [7, 7, 7, 7, 7, 7], [20, 21, 22, 20, 21, 22, 20]]
METHODS = ["ar", "ngram:k=4", "draft:k=3", "draft:ctrl=heuristic,k=4", "auto:profile=flat",
           "draft:k=5"]


def slot_engines(target, draft, methods):
    """One engine per request, each on a sequence of its own over the shared weights."""
    targets = target.sequences(len(methods))
    drafts = draft.sequences(len(methods))
    return [build_generator(m, t, None, d, eos_token_ids=[])
            for m, t, d in zip(methods, targets, drafts, strict=True)]


def run_together(decoder: BatchDecoder, requests, arrive_every: int = 0,
                 drop: dict | None = None, seats: dict | None = None):
    """Feed `requests` (key -> steps) into the decoder, one more every `arrive_every`
    rounds (0: all at once), until all end; results by key (an Exception for a failed one).
    drop: key -> round at which that request is cancelled; seats: key -> the seat its steps
    were given (`BatchDecoder.seat`)."""
    pending = list(requests.items())
    results: dict = {}
    chunks: dict = {key: [] for key in requests}
    rounds = 0
    while pending or len(decoder):
        if pending and (arrive_every == 0 or rounds % arrive_every == 0):
            while pending:
                key, steps = pending.pop(0)
                decoder.add(key, steps, (seats or {}).get(key))
                if arrive_every:
                    break
        for key, item in decoder.round():
            if isinstance(item, StreamChunk):
                chunks[key].extend(item.token_ids)
            else:
                results[key] = item
        for key, at in (drop or {}).items():
            if rounds == at and key in decoder:
                decoder.drop(key)
                results[key] = "dropped"
        rounds += 1
        assert rounds < 10_000
    return results, chunks


def alone(target, draft, method, prompt, n, sampling=None, stop=()):
    engine = build_generator(method, TorchBackend(target.model), None, TorchBackend(draft.model),
                          eos_token_ids=[])
    return engine.generate(prompt, max_new_tokens=n, sampling=sampling, stop=stop)


def count_cuts(decoder: BatchDecoder) -> list[int]:
    """A one-item list that counts the drafted tokens the decoder's pricing cuts, round by
    round, from now on."""
    cuts = [0]
    original = decoder._run_calls

    def counting(events):
        original(events)
        cuts[0] += decoder.last.cut

    decoder._run_calls = counting  # type: ignore[method-assign]
    return cuts


def steep_cost(tokens: int, sequences: int) -> float:
    """A call whose every token costs as much as the call itself: drafts never pay."""
    return 10.0 * tokens


def flat_cost(tokens: int, sequences: int) -> float:
    """A call whose drafted tokens cost almost nothing beside its requests' own rows (10 ms
    each): with requests queued behind the batch (`BatchDecoder.waiting`) every draft pays,
    since any accepted token hands a place on sooner."""
    return 10.0 * sequences + 1e-9 * tokens


@pytest.mark.parametrize("cost", [None, steep_cost, flat_cost], ids=["unpriced", "steep", "flat"])
@pytest.mark.parametrize("arrive_every", [0, 3])
def test_greedy_together_equals_alone(target, draft, cost, arrive_every):
    engines = slot_engines(target, draft, METHODS)
    lengths = [30, 12, 40, 25, 33, 18]
    requests = {i: e.stream_steps(p, max_new_tokens=n)
                for i, (e, p, n) in enumerate(zip(engines, PROMPTS, lengths, strict=True))}
    decoder = BatchDecoder(cost=cost)
    decoder.waiting = 1
    cuts = count_cuts(decoder)
    results, chunks = run_together(decoder, requests, arrive_every)
    cut = cuts[0]
    for i, (method, prompt, n) in enumerate(zip(METHODS, PROMPTS, lengths, strict=True)):
        want = alone(target, draft, method, prompt, n)
        assert isinstance(results[i], GenerationResult), results[i]
        assert results[i].token_ids == want.token_ids, (method, prompt)
        assert chunks[i] == want.token_ids
    if cost is steep_cost:
        assert cut > 0  # the pricing cut drafts, and outputs did not change
        assert sum(r.stats.drafted for r in results.values()) == 0
    if cost is flat_cost or cost is None:
        assert cut == 0


@pytest.mark.parametrize("waiting", [0, 1], ids=["alone", "one queued"])
def test_a_request_alone_is_verified_as_its_drafter_proposed(target, draft, waiting):
    """Alone in its rounds (none queued, no prompt beside it), a request's drafts are
    verified as its drafter proposed them, as `run_alone` does: under costs where every
    drafted token costs a whole call the batch's pricing would cut them all, and does with a
    request queued behind it. Either way the output is the request's alone."""
    engine, = slot_engines(target, draft, ["ngram:k=4"])
    prompt = PROMPTS[5]
    decoder = BatchDecoder(cost=steep_cost)
    decoder.waiting = waiting
    cuts = count_cuts(decoder)
    results, _ = run_together(decoder, {0: engine.stream_steps(prompt, max_new_tokens=30)})
    cut = cuts[0]
    want = alone(target, draft, "ngram:k=4", prompt, 30)
    assert results[0].token_ids == want.token_ids
    if waiting:
        assert cut > 0 and results[0].stats.drafted == 0
    else:
        assert cut == 0 and results[0].stats.drafted == want.stats.drafted > 0


def test_stop_strings_and_lengths_together(target, draft, tokenizer):
    engines = [build_generator(m, t, tokenizer, d, eos_token_ids=[])
               for m, t, d in zip(["ngram:k=4", "ar", "draft:k=3"], target.sequences(3),
                                  draft.sequences(3), strict=True)]
    prompts = ["abcabcabc", "hello hello", "xyz"]
    stops = [["ca"], [], ["q", "zz"]]
    requests = {i: e.stream_steps(p, max_new_tokens=20, stop=s, chat=False)
                for i, (e, p, s) in enumerate(zip(engines, prompts, stops, strict=True))}
    results, _ = run_together(BatchDecoder(cost=flat_cost), requests)
    for i, (m, p, s) in enumerate(zip(["ngram:k=4", "ar", "draft:k=3"], prompts, stops,
                                      strict=True)):
        engine = build_generator(m, TorchBackend(target.model), tokenizer,
                              TorchBackend(draft.model), eos_token_ids=[])
        want = engine.generate(p, max_new_tokens=20, stop=s, chat=False)
        assert (results[i].text, results[i].finish_reason) == (want.text, want.finish_reason)


def _expected_net(accepts, lengths, worth, cost, fixed=0):
    """ms the batch is expected to end sooner by with these lengths, net of the call."""
    n = len(accepts)
    saved = 0.0
    for a, k, w in zip(accepts, lengths, worth, strict=True):
        p = 1.0
        for x in a[:k]:
            p *= x
            saved += p * w
    return saved - (cost(n + fixed + sum(lengths), n) - cost(n + fixed, n))


def test_choose_lengths_never_expects_less_than_no_drafts_and_is_best_for_linear_calls():
    import itertools

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 5, (1,), generator=g))
        accepts = [torch.rand(int(torch.randint(0, 4, (1,), generator=g)), generator=g).tolist()
                   for _ in range(n)]
        worth = (torch.rand(n, generator=g) * 40).tolist()
        slope = float(torch.rand(1, generator=g)) * 20

        def cost(tokens, sequences, slope=slope):
            return 20.0 + 5.0 * sequences + slope * tokens

        lengths = choose_lengths(accepts, 0, cost, worth)
        assert all(0 <= k <= len(a) for a, k in zip(accepts, lengths, strict=True))
        got = _expected_net(accepts, lengths, worth, cost)
        assert got >= 0.0
        best = max(_expected_net(accepts, list(ks), worth, cost)
                   for ks in itertools.product(*(range(len(a) + 1) for a in accepts)))
        assert got == pytest.approx(best, abs=1e-9)  # greedy is optimal when calls are linear
    # the slack goes where it pays most: the sure draft before the doubtful one
    assert choose_lengths([[0.99, 0.99], [0.1, 0.1]], 0, lambda t, s: 10 + t, [5, 5]) == [2, 0]
    assert choose_lengths([[0.9], [0.9]], 0, lambda t, s: 10.0 * t, [10, 10]) == [0, 0]


def test_a_token_is_worth_what_it_shortens_the_batch_by():
    """`BatchLoad.token_ms`: a request that outlasts every other saves its steps at the end,
    where it runs alone: a whole call for every `pace` accepted tokens; one that ends while
    others go on saves a row of a later call, no more than its drafted row costs now (a tie
    counts as outlasting it); requests that all draft well end sooner together; with
    requests waiting, its place goes to the next one sooner, so a token is worth the batch's
    time per token."""
    from adaspec.cost.batch import BatchLoad

    def cost(tokens: int, sequences: int) -> float:
        return 20.0 + 10.0 * sequences + 8.0 * (tokens - sequences)

    load = BatchLoad(cost, sequences=3, budgets=[100, 50, 50])
    assert load.token_ms(100) == cost(1, 1) == 30.0  # the last to end: a call of its own
    # ... for each of its tokens where it runs alone at the end, making 2.5 tokens a step
    assert load.token_ms(100, pace=2.5) == pytest.approx(30.0 / 2.5)
    assert load.token_ms(50) == 0.0  # the other 50 outlasts it: a drafted row for a row
    assert load.token_ms(20) == 0.0
    load.waiting = 1
    assert load.token_ms(50) == pytest.approx(cost(3, 3) / 3)
    # so at acceptance 0.7 (a drafted token costs 8 ms here) only the longest request drafts
    load.waiting = 0
    worth = [load.token_ms(b) for b in load.budgets]
    assert choose_lengths([[0.7], [0.7], [0.7]], 0, cost, worth) == [1, 0, 0]
    # negative control: priced at the batch's time per token, the short ones draft as well
    assert choose_lengths([[0.7], [0.7], [0.7]], 0, cost, [cost(3, 3) / 3] * 3) == [1, 1, 1]
    # two requests that both draft well (3 and 2 tokens a step) need 50 rounds at the
    # least, not 100: the batch's end waits on both, and a token is worth half their call
    both = BatchLoad(cost, sequences=2, budgets=[100, 100], paces=[3.0, 2.0])
    assert both.least_rounds() == 50.0
    assert both.token_ms(100) == pytest.approx(cost(2, 2) / 2)
    assert both.token_ms(100, pace=3.0) == pytest.approx(cost(2, 2) / 2 / 3)  # 3 a step
    assert BatchLoad(cost, 2, budgets=[100, 100], paces=[3.0]).token_ms(100) == 0.0


def test_cancel_mid_batch_leaves_the_others(target, draft):
    engines = slot_engines(target, draft, METHODS[:4])
    requests = {i: e.stream_steps(p, max_new_tokens=30)
                for i, (e, p) in enumerate(zip(engines, PROMPTS, strict=False))}
    results, _ = run_together(BatchDecoder(cost=flat_cost), requests, drop={1: 3})
    assert results[1] == "dropped"
    for i in (0, 2, 3):
        assert results[i].token_ids == alone(target, draft, METHODS[i], PROMPTS[i], 30).token_ids


def test_a_failing_request_leaves_the_others(target, draft):
    engines = slot_engines(target, draft, ["draft:k=3", "ngram:k=4", "ar"])
    calls = {"n": 0}
    propose = engines[0].drafter.propose

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("draft model crashed")
        return propose(*args, **kwargs)

    engines[0].drafter.propose = failing
    requests = {i: e.stream_steps(p, max_new_tokens=25)
                for i, (e, p) in enumerate(zip(engines, PROMPTS, strict=False))}
    results, _ = run_together(BatchDecoder(cost=flat_cost), requests)
    assert isinstance(results[0], RuntimeError)
    for i, m in ((1, "ngram:k=4"), (2, "ar")):
        assert results[i].token_ids == alone(target, draft, m, PROMPTS[i], 25).token_ids


# ------------------------------------------------------------------------------- sampling


@pytest.fixture(scope="module")
def pair():
    return tiny_model(vocab=V, seed=5, sharpen=6.0), tiny_model(vocab=V, seed=6, layers=1,
                                                                sharpen=6.0)


PARAMS = SamplingParams(1.0, top_k=6)
OTHER = [4, 4, 1]  # the companions' prompt


class SwappedRows(BatchDecoder):
    """A broken batch: each round hands every request the rows of another one of the same
    shape (what a wrong offset into one runtime call's rows does)."""

    def _run_calls(self, events):
        super()._run_calls(events)
        calls = [m.call for m in self._members.values()
                 if m.call is not None and m.call.out is not None and m.call.proposal]
        by_shape: dict = {}
        for call in calls:
            by_shape.setdefault(tuple(call.out.logits.shape), []).append(call)
        for group in by_shape.values():
            outs = [c.out for c in group]
            for c, o in zip(group, outs[1:] + outs[:1], strict=True):
                c.out = o


def sampled_cells(target_model, draft_model, decoder_type, runs: int, seeded: bool):
    """The first three tokens of `runs` requests for PROMPT, decoded 4 at a time beside 4
    requests for another prompt, as cells a * V^2 + b * V + c; on the static decoder's
    sequences (`sampling_backend`): one batched cache, every call scoring all of them."""
    t, d = sampling_backend(target_model), sampling_backend(draft_model)
    methods = ["draft:k=3", "ngram:k=2", "draft:k=2", "ar"] * 2
    cells = []
    engines = slot_engines(t, d, methods)
    for wave in range(runs // 4):
        requests = {}
        for i, engine in enumerate(engines):
            mine = i % 2 == 0
            seed = wave * 8 + i if seeded else None
            requests[i] = engine.stream_steps(PROMPT if mine else OTHER, max_new_tokens=5,
                                              sampling=SamplingParams(1.0, top_k=6, seed=seed))
        results, _ = run_together(decoder_type(cost=flat_cost), requests)
        for i in range(0, 8, 2):
            a, b, c = results[i].token_ids[:3]
            cells.append((a * V + b) * V + c)
    return torch.tensor(cells)


def test_concurrent_sampling_follows_the_target_law(pair):
    target_model, draft_model = pair
    cells = sampled_cells(target_model, draft_model, BatchDecoder, 1000, seeded=False)
    assert_exact(check(cells, target_model, PARAMS), "together")


def test_swapped_rows_are_caught(pair):
    target_model, draft_model = pair
    # 300 requests put 50-70 samples where the target's law is 0 (p = 0 outright)
    cells = sampled_cells(target_model, draft_model, SwappedRows, 300, seeded=False)
    assert_caught(check(cells, target_model, PARAMS), "swapped rows")


def seeded_outputs(target_model, draft_model, companions: list[str], method="draft:k=3"):
    t, d = TorchBackend(target_model), TorchBackend(draft_model)
    methods = [method, *companions]
    engines = slot_engines(t, d, methods)
    decoder = BatchDecoder(cost=steep_cost)
    seats = [decoder.seat() for _ in engines]  # drafters that price their drafts see the batch
    requests = {0: engines[0].stream_steps(PROMPT, max_new_tokens=12,
                                           sampling=SamplingParams(1.0, top_k=6, seed=7),
                                           seat=seats[0])}
    for i, engine in enumerate(engines[1:], 1):
        requests[i] = engine.stream_steps(OTHER, max_new_tokens=12,
                                          sampling=SamplingParams(1.0, top_k=6, seed=100 + i),
                                          seat=seats[i])
    results, _ = run_together(decoder, requests, seats=dict(enumerate(seats)))
    return results[0].token_ids


@pytest.mark.parametrize("method", ["draft:k=3", "auto:profile=flat"])
def test_seeded_request_ignores_its_companions(pair, method):
    """`auto` joined to the batch prices a seeded sampled request as alone (else its
    proposals, hence its draws, would follow how many companions it has)."""
    target_model, draft_model = pair
    outputs = {tuple(seeded_outputs(target_model, draft_model, c, method))
               for c in ([], ["ar"], ["draft:k=2", "ngram:k=3"], ["ar"] * 5)}
    assert len(outputs) == 1


def test_a_shared_generator_is_caught(pair, monkeypatch):
    """The negative control: requests drawing from one generator depend on each other."""
    target_model, draft_model = pair
    shared = torch.Generator().manual_seed(0)

    def one_generator(self):
        return shared

    monkeypatch.setattr(SamplingParams, "generator", one_generator)
    outputs = set()
    for companions in ([], ["ar"], ["draft:k=2", "ngram:k=3"], ["ar"] * 5):
        shared.manual_seed(7)
        outputs.add(tuple(seeded_outputs(target_model, draft_model, companions)))
    assert len(outputs) > 1


def test_module_names_its_default_prefill_budget():
    assert batch_mod.PREFILL_TOKENS >= 1


def test_drafts_go_to_the_requests_the_batch_s_end_waits_on():
    """Of two equally good drafts, the request with more to go keeps its draft: its accepted
    tokens end the batch's work sooner by a whole call, the other's by its row of a call
    (`BatchLoad.token_ms`), which here is less than the drafted token adds. Two requests
    with as much to go where one has nothing to draft: the batch ends when that one does,
    so the other's draft saves only a row. Two that both draft well end sooner together,
    and both draft; so do both with a request waiting for a place (finishing sooner hands
    it the place)."""
    from adaspec.core.proposal import Proposal
    from adaspec.cost.batch import BatchLoad, Seat
    from adaspec.engine.batch import RoundStats, _Member
    from adaspec.engine.steps import TargetCall

    def member(key: str, remaining: int, drafts: bool = True) -> _Member:
        proposal = Proposal.chain(7, [1, 2, 3] if drafts else [],
                                  accept=[0.9, 0.9, 0.9] if drafts else None)
        tokens, positions, mask = proposal.target_inputs(0)
        call = TargetCall(None, tokens, positions, mask,  # type: ignore[arg-type]
                          proposal=proposal, root=0, remaining=remaining)
        return _Member(key, iter(()), Seat(BatchLoad()), call)

    def cost(tokens: int, sequences: int) -> float:
        return 30.0 + 10.0 * sequences + 6.0 * max(0, tokens - sequences)

    def lengths(members: list[_Member], waiting: int = 0) -> list[int]:
        decoder = BatchDecoder(cost)
        decoder._members = {m.key: m for m in members}
        decoder.load.waiting = waiting
        stats = RoundStats()
        decoder._price(members, 0, 0, stats)
        return stats.lengths

    assert lengths([member("short", 5), member("long", 100)]) == [0, 3]
    assert lengths([member("a", 100), member("b", 100, drafts=False)]) == [0, 0]
    assert lengths([member("a", 100), member("b", 100)]) == [3, 3]
    assert lengths([member("a", 100), member("b", 100, drafts=False)], waiting=1) == [3, 0]


def _auto_wave(target, draft, cost, join: bool):
    """Four `auto` requests decoded together under `cost`, their drafters joined to the
    batch or priced as requests alone: (results, draft-model calls in all)."""
    engines = slot_engines(target, draft, ["auto:profile=flat"] * 4)
    decoder = BatchDecoder(cost=cost)
    seats = [decoder.seat() if join else None for _ in engines]
    requests = {i: e.stream_steps(p, max_new_tokens=24, seat=seats[i])
                for i, (e, p) in enumerate(zip(engines, PROMPTS[:4], strict=True))}
    for key, steps in requests.items():
        decoder.add(key, steps, seats[key])
    results: dict = {}
    while len(decoder):
        for key, item in decoder.round():
            if isinstance(item, GenerationResult):
                results[key] = item
    return results, sum(r.stats.draft_calls for r in results.values())


def test_a_joined_auto_does_not_draft_what_the_batch_would_cut(target, draft):
    """Priced as a request alone, auto runs its draft model and the batch's pricing then
    throws the draft away (drafting time every request of the round waits for); joined to
    the batch (a seat, `BatchDecoder.seat`), it sees the round's call and does not draft
    at all. Greedy outputs are the same either way, and as alone."""
    joined, joined_calls = _auto_wave(target, draft, steep_cost, join=True)
    apart, apart_calls = _auto_wave(target, draft, steep_cost, join=False)
    assert apart_calls > 0  # negative control: the old pricing drafts in vain
    assert joined_calls == 0
    for i, prompt in enumerate(PROMPTS[:4]):
        want = alone(target, draft, "auto:profile=flat", prompt, 24).token_ids
        assert joined[i].token_ids == want == apart[i].token_ids


def test_a_joined_auto_still_drafts_where_the_batch_pays(target, draft):
    def slow_call(tokens: int, sequences: int) -> float:
        """Each request's row far dearer than a draft step, drafted tokens nearly free:
        drafting pays."""
        return 1000.0 * sequences + 1e-9 * tokens

    _, calls = _auto_wave(target, draft, slow_call, join=True)
    assert calls > 0


def test_a_prompt_chunk_in_the_call_does_not_make_weak_drafts_look_cheap():
    """Beside a long prompt chunk a round's call is long, and a drafted token adds little to
    it in proportion; it still adds its own time, which the tokens it is expected to save
    must exceed, as in a decode round."""

    def cost(tokens: int, sequences: int) -> float:
        return 100.0 + 10.0 * tokens  # a token 10 ms more, beside a chunk or not

    for chunk in (0, 200):
        assert choose_lengths([[0.05], []], chunk, cost, [120.0, 120.0]) == [0, 0]
        assert choose_lengths([[0.5], []], chunk, cost, [120.0, 120.0]) == [1, 0]


def test_batch_load_prices_one_request_as_alone():
    from adaspec.cost.batch import BatchLoad

    assert not BatchLoad(None, 5).shared  # unpriced batch: drafters price as alone
    load = BatchLoad(steep_cost, 3)
    assert load.call_ms(2) == steep_cost(5, 3)
    assert not BatchLoad(steep_cost, 1).shared and BatchLoad(steep_cost, 3).shared


def test_a_joined_auto_proposes_its_free_drafts_whole_and_the_batch_cuts_them(target, draft):
    """An n-gram continuation costs nothing to make: in a batch, auto proposes as much of it
    as a request alone would verify, even where the batch's pricing leaves it no token worth
    its row (here a companion with as much to go and nothing to draft keeps the batch
    going), so the batch sees the request's pace and does the cutting. Priced as alone,
    the same proposal; the batch then verifies none of it."""
    from adaspec.cost.batch import BatchLoad, Seat

    engine = build_generator("auto:profile=flat,use=ngram", target, None, None,
                          eos_token_ids=[])
    drafter = engine.drafter
    context = [5, 6, 7, 8, 9] * 4
    alone = drafter.propose(RequestState.of(context), 8, engine.controller)
    assert alone.depth > 0
    load = BatchLoad(steep_cost, sequences=2, budgets=[50, 50], paces=[1.0, 1.0])
    seat = Seat(load)
    joined = drafter.propose(RequestState.of(context, remaining=50, seat=seat), 8,
                             engine.controller)
    assert drafter._base(len(context)) == float("inf")  # no token of it shortens the batch
    assert joined.depth == alone.depth
    worth = [load.token_ms(50)] * 2
    assert choose_lengths([joined.accept, []], 0, steep_cost, worth) == [0, 0]


def test_a_draft_beside_a_prompt_chunk_is_priced_in_that_call(target, draft):
    """A prompt being prefilled in chunks is no decoding request (it emits nothing this
    round), but its chunk rides in the round's call: the load counts it as a sequence of
    that many tokens, and auto prices a draft of the one decoding request in that call
    (where a drafted token costs little beside the chunk) rather than as a call alone."""
    from adaspec.cost.batch import BatchLoad, Seat

    load = BatchLoad(steep_cost, 1, prompts=1, prompt_tokens=200, budgets=[6, 4])
    assert load.shared
    assert load.call_ms(2) == steep_cost(203, 2)
    engine = build_generator("auto:profile=flat", target, None, draft, eos_token_ids=[])
    drafter = engine.drafter
    drafter._seat = Seat(load)
    drafter._remaining = 6
    overhead = drafter.profile.overhead_ms
    assert drafter._verify_ms(2, 10) == steep_cost(203, 2) + overhead
    # it outlasts the prompt's request: a token saves a call of its own (10 ms), and the
    # round's call is worth that many of its tokens
    assert drafter._base(10) == pytest.approx((steep_cost(201, 2) + overhead) / 10.0)
    load.budgets = [6, 8]  # the prompt's request outlasts it: no token of it is worth a row
    assert drafter._base(10) == float("inf")
    drafter._seat = Seat(BatchLoad(steep_cost, 1))  # nothing rides along: priced as alone
    assert drafter._verify_ms(2, 10) == drafter.profile.target_ms(3, 10) + overhead
    assert drafter._base(10) == 1.0

    from adaspec.backends.torch.static import static_backend

    views = static_backend(target.model, "tiny").sequences(2)  # prompts go in chunks
    engines = [build_generator("ar", v, None, None, eos_token_ids=[]) for v in views]
    decoder = BatchDecoder(cost=steep_cost, prefill_tokens=4)
    short, long = decoder.seat(), decoder.seat()
    decoder.add("short", engines[0].stream_steps(PROMPTS[0], max_new_tokens=6, seat=short),
                short)
    decoder.add("long", engines[1].stream_steps(PROMPTS[2] * 2, max_new_tokens=6, seat=long),
                long)
    seen = []
    while len(decoder):
        decoder.round()
        seen.append((decoder.load.sequences, decoder.load.prompts,
                     decoder.load.prompt_tokens))
    # while the long prompt's 24 tokens go in chunks of 4, the short request decodes beside
    assert (1, 1, 4) in seen
    assert seen[-1][1:] == (0, 0)


def test_a_shape_is_read_against_the_plain_call_of_its_own_round():
    """The batch cost reads each shape as the plain call's median times the median of its
    ratio to the plain call timed beside it: a shape caught in the machine's slow moments
    (which slow its round's plain call alike) does not come out dearer than the rest, and a
    shape that is dearer in every round is, however its fastest round read (a drafted token
    in a call of eight, 144 ms at its fastest like the plain call, 17% dearer by ratio)."""
    from adaspec.cost.batch import settled_ms

    plain = [150.0, 300.0, 310.0, 160.0, 290.0]
    assert settled_ms(plain, plain) == 290.0
    slowed = [2 * p for p in plain]  # twice the plain call in every round
    assert settled_ms(plain, slowed) == 580.0
    caught = [180.0, 300.0, 320.0, 190.0, 300.0]  # ~ the plain call, slow where it was
    assert settled_ms(plain, caught) < 1.1 * settled_ms(plain, plain)
    dearer = [145.0, 350.0, 360.0, 190.0, 340.0]  # min alike, 17% dearer by ratio
    assert min(dearer) < min(plain) and settled_ms(plain, dearer) > 1.1 * 290.0


def test_the_timed_shapes_put_a_draft_on_one_sequence():
    from adaspec.cost.batch import call_lengths

    assert call_lengths(8, 16) == [2] * 8
    assert call_lengths(8, 9) == [1] * 7 + [2]
    assert call_lengths(4, 8) == [2] * 4
    assert call_lengths(1, 5) == [5]


def test_a_batch_cost_measured_with_fewer_sequences_is_measured_again_wider(monkeypatch,
                                                                             tmp_path):
    """A server with 8 slots does not price its rounds from a curve a 2-slot server stored
    (its 8-sequence calls would be read off the 2-sequence row); the wider curve is kept."""
    from adaspec.cost import batch as cb
    from adaspec.cost import cache
    from adaspec.cost.profile import Curve

    monkeypatch.setattr(cache, "profiles_dir", lambda: tmp_path)
    widths = []

    def fake_measure(views, key, progress=None):
        seqs = [s for s in cb.SEQUENCES if s <= cb._most_sequences(len(views))]
        widths.append(seqs[-1])
        rows = [[10.0 * s + n for n in (1, 64)] for s in seqs]
        return cb.BatchCost(Curve([1, 64], seqs, rows), key)

    monkeypatch.setattr(cb, "measure_batch_cost", fake_measure)
    target = TorchBackend(tiny_model(seed=1))
    cb.batch_cost_for(target, [target] * 2)
    cb.batch_cost_for(target, [target] * 2)  # read back
    cb.batch_cost_for(target, [target] * 8)  # wider: measured again
    cb.batch_cost_for(target, [target] * 4)  # the 8-sequence curve serves 4
    assert widths == [2, 8]


def test_a_round_is_modelled_by_the_batch_cost_of_its_call():
    """`modelled_ms`: the last round's call priced by the curve (what /metrics adds up as
    modelled seconds), none where the batch is unpriced or the round made no call."""
    from adaspec.engine.batch import RoundStats

    def cost(tokens: int, sequences: int) -> float:
        return 10.0 * tokens + sequences

    decoder = BatchDecoder(cost)
    assert decoder.modelled_ms() is None  # no round yet
    decoder.last = RoundStats(sequences=3, tokens=7, call_seconds=9.0)
    assert decoder.modelled_ms() == 73.0  # the call's shape, not its timed seconds
    unpriced = BatchDecoder(None)
    unpriced.last = RoundStats(sequences=3, tokens=7)
    assert unpriced.modelled_ms() is None


class _Call:
    """A stand-in for a `TargetCall` a scripted request yields (`run_alone` drives it)."""

    def __init__(self, log: list, fail: bool = False) -> None:
        self.log, self.fail = log, fail
        self.backend, self.prompt_reuse, self.proposal, self.out = object(), None, None, None
        self.tokens, self.seconds, self.remaining, self.fixed = torch.tensor([1]), 0.0, 0, True

    def run(self):
        self.log.append("call")
        if self.fail:
            raise RuntimeError("the runtime failed")
        self.out = "scored"
        return self.out


def test_a_request_alone_is_a_batch_of_one_that_hands_on_each_chunk_first(monkeypatch):
    """run_alone: each chunk reaches the caller before the request's next step drafts, each
    call runs as it comes, a failing call is raised, and a caller that stops early closes
    the request's steps."""
    monkeypatch.setattr(batch_mod, "TargetCall", _Call)
    log: list[str] = []

    def steps(fail: bool = False):
        try:
            for i in range(2):
                log.append(f"draft {i}")
                call = _Call(log, fail)
                yield call
                assert call.out == "scored"
                yield StreamChunk(text=str(i), token_ids=[i])
            yield GenerationResult(text="01", token_ids=[0, 1], stats=RequestStats(),
                                   finish_reason="length")
        finally:
            log.append("closed")

    seen = []
    for item in batch_mod.run_alone(steps()):
        log.append(f"caller got {type(item).__name__}")
        seen.append(item)
    assert [type(x) for x in seen] == [StreamChunk, StreamChunk, GenerationResult]
    assert log == ["draft 0", "call", "caller got StreamChunk", "draft 1", "call",
                   "caller got StreamChunk", "caller got GenerationResult", "closed"]
    log.clear()
    with pytest.raises(RuntimeError, match="the runtime failed"):
        list(batch_mod.run_alone(steps(fail=True)))
    assert log == ["draft 0", "call", "closed"]
    log.clear()
    run = batch_mod.run_alone(steps())
    next(run)
    run.close()
    assert log == ["draft 0", "call", "closed"]
