"""The cross-request history (draft/history.py): what it proposes, its budget, its file, and
`auto` drafting from it end to end (exact, and learning from the requests it served)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from adaspec.core.request import RequestState
from adaspec.cost.profile import CostProfile, Curve
from adaspec.draft.auto import AutoDrafter, history_cell
from adaspec.draft.history import (
    HistoryFileError,
    HistoryIndex,
    _Many,
    tokenizer_key,
)
from adaspec.errors import InputError
from adaspec.methods.build import build_generator
from adaspec.methods.spec import parse_method

from .test_auto import flat_profile
from .test_engine import PROMPTS, reference_greedy

KEY = "ids:100"


def index(**kwargs) -> HistoryIndex:
    return HistoryIndex(100, tokenizer=KEY, **kwargs)


def table(h: HistoryIndex) -> dict:
    """The index's counts, comparable: n-gram key -> (counts in recency order, best)."""
    out = {}
    for key, value in h._table.items():
        if isinstance(value, _Many):
            out[key] = (list(value.counts.items()), value.best, value.best_count, value.total)
        else:
            token, count = value & h._token_mask, value >> h.bits
            out[key] = ([(token, count)], token, count, count)
    return out


# ----------------------------------------------------------------------------- lookup
def test_lookup_finds_a_continuation_seen_in_an_earlier_request():
    h = index(orders=(2, 3))
    h.add_request([50, 51, 52], [10, 11, 12, 13, 14, 15])
    found = h.lookup([99, 98, 11, 12], 8)  # another request reaches "11 12"
    assert found.tokens == [13, 14, 15] and found.match == 2
    assert found.orders == [2, 3, 3]  # the drafted path matches longer n-grams
    assert found.confidence == [0.5, 0.5, 0.5]  # each seen once: 1 / (1 + 1)
    assert h.lookup([99, 98, 11, 12], 2).tokens == [13, 14]  # at most k
    # across the prompt / output boundary: what starts an answer
    assert h.lookup([7, 51, 52], 3).tokens == [10, 11, 12]
    assert h.lookup([1, 2, 3], 4).tokens == []  # nothing seen
    assert h.lookup([12], 4).tokens == []  # shorter than the shortest n-gram


def test_frequency_beats_recency_and_ties_go_to_the_most_recent():
    h = index(orders=(2, 3))
    h.add([1, 2, 3, 40])
    h.add([1, 2, 3, 40])
    h.add([1, 2, 3, 41])  # most recent, but seen once against twice
    found = h.lookup([2, 3], 1)
    assert found.tokens == [40] and found.confidence == [2 / 4]
    h.add([1, 2, 3, 41])  # now 2 against 2: the most recent wins
    assert h.lookup([2, 3], 1).tokens == [41]
    h.add([1, 2, 3, 40])
    assert h.lookup([2, 3], 1).tokens == [40]


def test_a_longer_match_wins_and_the_path_stops_when_it_gets_unlikely():
    h = index(orders=(1, 2, 3), min_prob=0.3)
    h.add([5, 6, 7, 8, 9])
    h.add([1, 6, 7, 20])
    # "6 7" was followed by 8 and by 20; "5 6 7" only by 8
    assert h.lookup([5, 6, 7], 4).tokens == [8, 9]
    assert h.lookup([1, 6, 7], 4).tokens == [20]
    # "0 6 7" is unseen: the 2-gram "6 7" answers, 20 (the most recent of a tie, share 1/2)
    assert h.lookup([0, 6, 7], 4).tokens == [20]
    strict = index(orders=(1, 2, 3), min_prob=0.6)
    strict.add([5, 6, 7, 8])
    strict.add([1, 6, 7, 20])
    assert strict.lookup([0, 6, 7], 4).tokens == []  # 1/2 < 0.6: propose nothing


def test_lookup_never_crosses_documents():
    h = index(orders=(1, 2))
    h.add([1, 2])
    h.add([3, 4])
    assert h.lookup([1, 2], 3).tokens == []  # 2 ended its document: nothing followed it
    assert h.lookup([9, 1], 3).tokens == [2]


# ----------------------------------------------------------------------------- budget
def test_the_budget_evicts_the_oldest_documents():
    h = index(orders=(1, 2), budget=10)
    h.add([1, 2, 3, 4])  # oldest
    h.add([1, 2, 9, 9])
    assert h.lookup([1, 2], 1).tokens == [9]  # tie: the most recent
    h.add([5, 6, 7, 8])  # 12 tokens > 10: the first document goes
    assert h.tokens == 8 and h.documents == 2
    assert h.lookup([2, 3], 2).tokens == []  # only the evicted document had "2 3"
    assert h.lookup([0, 2], 1).tokens == [9]  # "2" is still followed by 9 (count 1)
    h.add(list(range(20, 40)))  # longer than the budget: its last 10 tokens stay alone
    assert h.tokens == 10 and h.documents == 1
    assert h.lookup([31], 2).tokens == [32, 33] and h.lookup([29], 2).tokens == []


def test_counts_after_evictions_equal_a_fresh_index_of_the_held_documents():
    rng = random.Random(0)
    for trial in range(20):
        budget = rng.randint(5, 60)
        live = index(orders=(1, 2, 3), budget=budget)
        for _ in range(rng.randint(1, 25)):
            live.add([rng.randrange(4) for _ in range(rng.randint(0, 12))])
        fresh = index(orders=(1, 2, 3), budget=budget)
        for doc in live._docs:
            fresh.add(doc)
        assert live.tokens == fresh.tokens <= budget
        assert table(live) == table(fresh), trial


def test_bad_settings_and_tokens_are_named():
    for bad in ((), (0, 2), (2.5,)):
        with pytest.raises(InputError, match="n-gram lengths"):
            HistoryIndex(100, orders=bad)
    with pytest.raises(InputError, match="budget"):
        HistoryIndex(100, budget=0)
    with pytest.raises(InputError, match="outside the history's vocabulary"):
        index().add([1, 2, 100])


# ----------------------------------------------------------------------------- file
def filled() -> HistoryIndex:
    h = index(orders=(2, 3))
    h.add_request([1, 2, 3], [4, 5, 6, 7])
    h.add_request([8, 2, 3], [4, 5, 9, 9, 9])
    h.add([0, 99, 0, 99])
    return h


def test_persistence_round_trips(tmp_path):
    h = filled()
    path = h.save(tmp_path / "h.history")
    back = HistoryIndex.load(path, KEY, 100, orders=(2, 3))
    assert (back.tokens, back.documents) == (h.tokens, h.documents)
    assert table(back) == table(h)
    assert back.lookup([2, 3], 4) == h.lookup([2, 3], 4)
    assert back.lookup([2, 3], 4).tokens == [4, 5, 9, 9]  # the most recent of the tie at "4 5"
    empty = index()
    empty.save(tmp_path / "empty.history")
    assert HistoryIndex.load(tmp_path / "empty.history", KEY, 100).tokens == 0


def refused(path: Path, key: str = KEY, vocab: int = 100) -> str:
    with pytest.raises(HistoryFileError) as info:
        HistoryIndex.load(path, key, vocab)
    message = str(info.value)
    assert "\n" not in message and str(path) in message  # one line, naming the file
    lines: list[str] = []
    h = HistoryIndex.load_or_new(path, key, vocab, report=lines.append)
    assert h.tokens == 0 and lines == [f"{message}; starting with an empty history"]
    return message


def test_a_corrupt_truncated_or_foreign_file_is_refused_in_one_line(tmp_path):
    path = filled().save(tmp_path / "h.history")
    data = path.read_bytes()
    cases = {
        "truncated": data[:-3],
        "cut in the header": data[:30],
        "flipped": data[:-5] + bytes([data[-5] ^ 1]) + data[-4:],
        "garbage": b"\x00\x01 not a history",
        "empty": b"",
        "newer": data.replace(b"adaspec-history 1", b"adaspec-history 9", 1),
    }
    expected = {"truncated": "truncated or corrupt", "cut in the header": "damaged header",
                "flipped": "checksum", "garbage": "not an adaspec history file",
                "empty": "not an adaspec history file", "newer": "format 9"}
    for name, content in cases.items():
        bad = tmp_path / f"{name.replace(' ', '-')}.history"
        bad.write_bytes(content)
        assert expected[name] in refused(bad), name
    assert "another tokenizer" in refused(path, key="vocab:100:abc")
    assert "another tokenizer" in refused(path, vocab=101)
    missing = tmp_path / "missing.history"
    assert HistoryIndex.load_or_new(missing, KEY, 100, report=pytest.fail).tokens == 0


def test_an_interrupted_save_leaves_the_old_file_valid(tmp_path, monkeypatch):
    import adaspec.store.atomic as atomic

    old = filled()
    path = old.save(tmp_path / "h.history")
    before = path.read_bytes()
    new = filled()
    new.add(list(range(50)))

    def crash(fd):  # the process dies after writing, before the rename
        raise OSError("simulated crash")

    monkeypatch.setattr(atomic.os, "fsync", crash)
    with pytest.raises(OSError, match="simulated"):
        new.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["h.history"]  # no temp file left
    assert table(HistoryIndex.load(path, KEY, 100, orders=(2, 3))) == table(old)


def test_tokenizer_key_follows_the_vocabulary(tokenizer):
    class Vocab:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return dict(self.vocab)

    a = tokenizer_key(Vocab({"a": 0, "b": 1}), 2)
    assert a == tokenizer_key(Vocab({"b": 1, "a": 0}), 2)
    assert a != tokenizer_key(Vocab({"a": 1, "b": 0}), 2)
    assert tokenizer_key(None, 64) == "ids:64" == tokenizer_key(tokenizer, 64)


def test_saving_needs_a_tokenizer_key(tmp_path):
    with pytest.raises(InputError, match="tokenizer key"):
        HistoryIndex(100).save(tmp_path / "h.history")


# ----------------------------------------------------------------------------- auto
def test_auto_method_strings_take_history():
    for text in ("auto:use=history", "auto:use=ngram+history", "auto:use=ngram+history+draft"):
        assert parse_method(text).params.sources == text.split("=")[1].split("+")
    assert not parse_method("auto:use=ngram+history").needs_draft_model()
    for bad in ("auto:use=history+history", "auto:use=ngram+hist", "auto:use="):
        with pytest.raises(InputError, match="use must"):
            parse_method(bad)


def history_engine(target, use: str = "history", history: HistoryIndex | None = None,
                   draft=None):
    return build_generator(f"auto:use={use}", target, None, draft, eos_token_ids=[],
                        profile=flat_profile(), history=history)


def mat(result) -> float:
    return result.stats.new_tokens / result.stats.target_calls


def test_a_repeated_request_gets_accepted_history_drafts(target, target_model):
    engine = history_engine(target)
    drafter = engine.drafter
    assert isinstance(drafter, AutoDrafter) and drafter.history is not None
    prompt = PROMPTS[1]
    expected = reference_greedy(target_model, prompt, 40)
    first = engine.generate(prompt, max_new_tokens=40)
    assert first.token_ids == expected
    assert first.stats.drafted == 0 and mat(first) == 1.0  # nothing seen yet
    second = engine.generate(prompt, max_new_tokens=40)
    assert second.token_ids == expected
    assert drafter.choices.history > 0 and second.stats.accepted > 0
    assert second.stats.drafted_by == {"history": second.stats.drafted}
    assert mat(second) > 2.0
    assert drafter.memory.history_outcomes[1] == second.stats.accepted


def test_negative_control_without_feeding_the_history_nothing_is_learned(
        target, monkeypatch):
    """The test above fails when finished requests do not reach the index."""
    monkeypatch.setattr(HistoryIndex, "add_request", lambda self, prompt, output: None)
    engine = history_engine(target)
    for _ in range(2):
        res = engine.generate(PROMPTS[1], max_new_tokens=40)
        assert res.stats.drafted == 0 and mat(res) == 1.0


@pytest.mark.parametrize("use", ["history", "ngram+history", "ngram+history+draft"])
def test_greedy_output_with_history_equals_plain_decoding(target, draft, target_model, use):
    shared = HistoryIndex(target.vocab_size)
    engine = history_engine(target, use, shared, draft)
    other = history_engine(target, "ngram+history", shared)  # another engine, the same index
    drafted = 0
    for prompt in [*PROMPTS, PROMPTS[0], PROMPTS[2], [*PROMPTS[2], 13, 14]]:
        for e in (engine, other):
            res = e.generate(prompt, max_new_tokens=30)
            assert res.token_ids == reference_greedy(target_model, prompt, 30), (use, prompt)
            drafted += res.stats.drafted_by.get("history", 0)
    assert drafted > 0
    assert shared.requests == 2 * 7 - 2  # all but the last of each engine (learned at its next)


def test_a_seeded_sampled_request_is_reproducible_with_the_history_on(target):
    from adaspec.core.sampling import SamplingParams

    engine = history_engine(target, "ngram+history")
    seeded = SamplingParams(temperature=0.8, seed=7)
    first = engine.generate(PROMPTS[1], max_new_tokens=30, sampling=seeded)
    for _ in range(2):  # the history now holds it
        again = engine.generate(PROMPTS[1], max_new_tokens=30, sampling=seeded)
        assert again.token_ids == first.token_ids
        assert "history" not in again.stats.drafted_by
    unseeded = engine.generate(PROMPTS[1], max_new_tokens=30,
                               sampling=SamplingParams(temperature=0.8))
    assert engine.drafter.history.requests == 3 and unseeded.stats.new_tokens == 30


def cpu_profile() -> CostProfile:
    """This machine's shape: verifying one drafted token costs 45% of a pass more, so a
    history token must be accepted with probability over 0.45 to pay."""
    sizes = list(range(1, 17))
    return CostProfile(target=Curve(sizes, [0], [[18.0 + 8.0 * (n - 1) for n in sizes]]))


def test_history_estimates_learn_from_steps_that_did_not_propose_them(target, target_model):
    """Continuations seen once are priced below what pays here, so they are never proposed
    at first; the estimates still learn, from the tokens each step emitted, that they are
    right (the same request again), and the history then drafts."""
    engine = build_generator("auto:use=history", target, None, None, eos_token_ids=[],
                          profile=cpu_profile())
    drafter = engine.drafter
    prompt = PROMPTS[1]
    expected = reference_greedy(target_model, prompt, 40)
    assert engine.generate(prompt, max_new_tokens=40).token_ids == expected
    before = {c: r.rate for c, r in drafter.memory.history_rates.items()}
    second = engine.generate(prompt, max_new_tokens=40)
    assert second.token_ids == expected
    learned = [c for c, r in drafter.memory.history_rates.items() if r.trials]
    assert learned and all(drafter.memory.history_rates[c].rate > before[c] for c in learned)
    assert second.stats.accepted > 0 and mat(second) > 2.5  # it drafted once it learned
    # (without that learning: 1.67, from the continuations this model repeats itself)
    assert drafter.memory.history_outcomes[1] == second.stats.accepted


def test_what_is_learned_ends_at_the_first_end_of_sequence(target, target_model):
    engine = history_engine(target)
    plain = reference_greedy(target_model, PROMPTS[0], 20)
    eos = plain[5]
    engine.drafter.eos_token_ids = {eos}
    engine.drafter.begin(RequestState.of(PROMPTS[0]))
    engine.drafter.commit(RequestState.of([*PROMPTS[0], *plain]), [])
    engine.drafter.learn()
    (doc,) = engine.drafter.history._docs
    assert list(doc) == [*PROMPTS[0], *plain[: plain.index(eos) + 1]]
    engine.drafter.learn()  # once per request
    assert engine.drafter.history.documents == 1


def test_history_cells_price_longer_surer_matches_and_runs_higher():
    d = AutoDrafter(flat_profile(), history=HistoryIndex(100))
    rate = {c: r.rate for c, r in d.memory.history_rates.items()}
    assert rate[history_cell(8, 0.5)] > rate[history_cell(4, 0.5)] > rate[history_cell(2, 0.5)]
    assert rate[history_cell(3, 0.95)] > rate[history_cell(3, 0.5)] > rate[history_cell(3, 0.2)]
    assert rate[history_cell(3, 0.5, run=4)] > rate[history_cell(3, 0.5, run=3)]
    assert history_cell(9, 0.5) == (8, 1, 0) and history_cell(7, 0.5) == (4, 1, 0)
    assert history_cell(2, 0.95, run=9) == (1, 3, 1)
