"""Several sequences in the static runtime (backends/torch/static_batch.py, issue 33): one call
scores every sequence's feed, each row what its sequence scores alone, through rollbacks and
a shared prompt prefix; requests decoded together on it give their outputs alone while
sharing the model's calls."""

from __future__ import annotations

import pytest
import torch

from adaspec.backends.sequences import ALL, LAST, NONE, forward_together
from adaspec.backends.torch.static import static_backend
from adaspec.engine.batch import BatchDecoder
from adaspec.engine.steps import GenerationResult
from adaspec.methods.build import build_generator

from .conftest import tiny_model
from .test_batch import run_together


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.float(), b.float(), atol=2e-4, rtol=2e-4)


# each sequence's own shape, or every row at the fixed shapes a GPU replays as graphs (run
# eagerly here)
GRAPHS = pytest.mark.parametrize("graphs", ["off", "eager"])


@GRAPHS
def test_one_call_scores_every_sequence_as_alone(graphs):
    model = tiny_model(seed=31, random_norms=True)
    views = static_backend(model, "tiny", graphs=graphs).sequences(3)
    owner = views[0].owner  # type: ignore[attr-defined]
    alone = [static_backend(model, f"alone{i}") for i in range(3)]
    prompts = [[4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18]]
    # prompts: the last row each (one call for all three)
    got = forward_together([(v, p, LAST) for v, p in zip(views, prompts, strict=True)])
    assert owner.calls == 1
    for g, a, p in zip(got, alone, prompts, strict=True):
        close(g, a.prefill(torch.tensor(p)).logits)
    # chains of different lengths after different cache lengths, every row
    chains = [[20, 21, 22], [23], [24, 25]]
    got = forward_together([(v, c, ALL) for v, c in zip(views, chains, strict=True)])
    for g, a, c in zip(got, alone, chains, strict=True):
        assert g.shape[0] == len(c)
        close(g, a.forward(torch.tensor(c)).logits)
    # a rollback in one sequence, then a feed of that one only with NONE and ALL rows
    views[0].truncate(6)
    alone[0].truncate(6)
    none, last = forward_together([(views[0], [30, 31], NONE), (views[2], [32], ALL)])
    assert none.shape[0] == 0
    alone[0].forward(torch.tensor([30, 31]))
    close(last, alone[2].forward(torch.tensor([32])).logits)
    close(views[0].forward(torch.tensor([33])).logits, alone[0].forward(torch.tensor([33])).logits)
    assert [v.cache_len for v in views] == [a.cache_len for a in alone]


@GRAPHS
def test_a_shared_prompt_prefix_is_copied_not_computed(graphs):
    model = tiny_model(seed=32, random_norms=True)
    views = static_backend(model, "tiny", graphs=graphs).sequences(2)
    system = list(range(1, 21))  # 20 tokens: above MIN_SHARE
    first, second = system + [40, 41], system + [42, 43, 44]
    views[0].prefill(torch.tensor(first))
    assert views[1].plan_prefill(second, 0) == second  # reuse 0: nothing kept or shared
    out = views[1].prefill(torch.tensor(second), reuse=len(second))
    assert views[1].shared_tokens == len(system)  # type: ignore[attr-defined]
    close(out.logits, static_backend(model, "alone").prefill(torch.tensor(second)).logits)


@GRAPHS
def test_requests_together_share_the_calls_and_keep_their_outputs(graphs):
    target = tiny_model(seed=33)
    draft = tiny_model(seed=34, layers=1)
    methods = ["ar", "ngram:k=4", "draft:k=3", "auto:profile=flat"]
    prompts = [[5, 9, 13, 2], [17, 3, 3, 3, 40, 41, 8], [1, 2, 3, 4, 5, 6, 7, 8], [20, 21, 20]]
    lengths = [20, 14, 25, 18]
    targets = static_backend(target, "t", graphs=graphs).sequences(len(methods))
    drafts = static_backend(draft, "d", graphs=graphs).sequences(len(methods))
    engines = [build_generator(m, t, None, d, eos_token_ids=[])
               for m, t, d in zip(methods, targets, drafts, strict=True)]
    requests = {i: e.stream_steps(p, max_new_tokens=n)
                for i, (e, p, n) in enumerate(zip(engines, prompts, lengths, strict=True))}
    results, _ = run_together(BatchDecoder(), requests)
    calls = 0
    for i, (m, p, n) in enumerate(zip(methods, prompts, lengths, strict=True)):
        want = build_generator(m, static_backend(target, "t"), None, static_backend(draft, "d"),
                            eos_token_ids=[]).generate(p, max_new_tokens=n)
        assert isinstance(results[i], GenerationResult)
        assert results[i].token_ids == want.token_ids, m
        calls += results[i].stats.target_calls
    owner = targets[0].owner  # type: ignore[attr-defined]
    assert owner.calls < calls / 2  # the requests' target passes went in shared calls


def test_fixed_rounds_pad_every_row_and_write_only_their_own_slots():
    """A decode round at fixed shapes: rows without a feed and a feed's padding write only
    scratch slots; the fixed pass was the one used (its shape recorded)."""
    model = tiny_model(seed=35, random_norms=True)
    views = static_backend(model, "tiny", graphs="eager").sequences(3)
    owner = views[0].owner  # type: ignore[attr-defined]
    forward_together([(views[0], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,
                                  20], LAST)])  # 17 tokens: a prompt chunk, its own shape
    assert owner._fixed == {}
    forward_together([(views[0], [21, 22, 23], ALL)])  # 3 tokens: padded to 4
    assert set(owner._fixed) == {(2, 4, 256, False)}  # rows 0-1: sequence 1 needs no more
    keys, _ = owner._cache[0]
    assert bool(keys[1, :, :20].abs().sum(-1).gt(0).all())  # sequence 1's 20 tokens
    assert not bool(keys[1, :, 20:owner.max_context].any())  # nothing past them
    assert not bool(keys[[0, 2, 3], :, :owner.max_context].any())  # the rows without a feed
    forward_together([(views[2], [7], LAST)])
    # sequence 3: all 4 rows
    assert set(owner._fixed) == {(2, 4, 256, False), (4, 1, 256, False)}
    assert owner.row_bucket(3) == 4 and owner.row_bucket(1) == 1 and owner.row_bucket(9) == 4


@GRAPHS
def test_routed_requests_decode_together(graphs):
    """The router on the static runtime's slots: a sequence's prompt state is the one the
    runtime gives alone, and routed requests decode together, each as its arm alone."""
    from adaspec.route.router import RoutedGenerator

    model = tiny_model(seed=36, random_norms=True)
    views = static_backend(model, "t", graphs=graphs).sequences(3)
    prompt = [5, 9, 13, 2, 5, 9]
    alone = static_backend(model, "alone")
    want_state = alone.prefill(torch.tensor(prompt), hidden_layer=alone.num_layers).hidden
    out = views[0].prefill(torch.tensor(prompt), hidden_layer=alone.num_layers)
    assert views[0].has_hidden_states and out.hidden is not None
    assert want_state is not None
    close(out.hidden[-1], want_state[-1])  # the last prompt token's (the router reads it)
    prompts = [prompt * 2, [17, 3, 3, 3, 40, 41, 8], [20, 21, 20, 21, 20]]
    picks = ["ar", "ngram:k=4", "ngram:k=4"]
    want = [build_generator(p, static_backend(model, "a"), None, None, eos_token_ids=[])
            .generate(q, 16).token_ids for p, q in zip(picks, prompts, strict=True)]
    routers = [RoutedGenerator({p: build_generator(p, v, None, None, eos_token_ids=[])
                                for p in ("ar", "ngram:k=4")}, force=pick)
               for v, pick in zip(views, picks, strict=True)]
    owner = views[0].owner  # type: ignore[attr-defined]
    calls = owner.calls
    results, _ = run_together(BatchDecoder(), {i: r.stream_steps(q, max_new_tokens=16)
                                               for i, (r, q) in enumerate(zip(routers, prompts,
                                                                              strict=True))})
    for i, pick in enumerate(picks):
        assert results[i].token_ids == want[i] and results[i].stats.route == pick
    steps = sum(results[i].stats.target_calls for i in range(3))
    assert owner.calls - calls < steps  # the arms' decode steps shared calls


@GRAPHS
def test_seeded_sampling_is_the_same_whatever_shares_the_batch(graphs):
    """A seeded sampled request draws the same tokens alone and beside other requests (in
    one batched pass, at fixed shapes or its own), with plain decoding and with a draft."""
    from adaspec.core.sampling import SamplingParams

    target = tiny_model(seed=37, random_norms=True)
    draft = tiny_model(seed=38, layers=1)
    prompt = [4, 8, 15, 16, 23]

    def run(method: str, seed: int, others: list) -> list[int]:
        targets = static_backend(target, "t", graphs=graphs).sequences(1 + len(others))
        drafts = static_backend(draft, "d", graphs=graphs).sequences(1 + len(others))
        engines = [build_generator(method, t, None, d, eos_token_ids=[])
                   for t, d in zip(targets, drafts, strict=True)]
        requests = {0: engines[0].stream_steps(prompt, 24, SamplingParams(0.9, seed=seed))}
        for i, (p, sampling) in enumerate(others, 1):
            requests[i] = engines[i].stream_steps(p, 16 + 3 * i, sampling)
        results, _ = run_together(BatchDecoder(), requests)
        assert isinstance(results[0], GenerationResult)
        return results[0].token_ids

    others = [([1, 2, 3], SamplingParams(0.7, seed=3)), ([9] * 6, None),
              ([30, 31, 32, 33], SamplingParams(1.0, seed=5))]
    for method in ("ar", "draft:k=3"):
        alone = run(method, 11, [])
        assert run(method, 11, others) == alone, method
        assert run(method, 12, others) != alone, method  # the seed does draw them


@GRAPHS
def test_the_runtime_returns_the_final_norms_rows_as_features(graphs):
    """A draft head reads the target's final-normed states from the pass that scored the
    rows: the static runtime returns the rows transformers' final norm gives, alone and for
    each of several sequences (at exact shapes and at the fixed ones a GPU replays), and
    nothing while not asked."""
    from adaspec.backends.torch.backend import TorchBackend

    model = tiny_model(seed=32, random_norms=True)  # a norm's weights show in its output
    ref = TorchBackend(model)
    ref.record_features(True)
    prompt, chain = torch.tensor([4, 5, 6, 7, 8]), torch.tensor([9, 10, 11])
    want_prompt = ref.prefill(prompt).features
    want_chain = ref.forward(chain).features
    assert want_prompt is not None and want_chain is not None

    alone = static_backend(model, "alone", graphs=graphs)
    assert alone.prefill(prompt).features is None  # not recorded unless asked
    alone.reset()
    alone.record_features(True)
    close(alone.prefill(prompt).features, want_prompt)
    out = alone.forward(chain)
    close(out.features, want_chain)
    close(out.logits, ref.model(torch.cat([prompt, chain])[None]).logits[0, -3:])

    views = static_backend(model, "tiny", graphs=graphs).sequences(2)
    views[0].record_features(True)  # the owner's calls, for every sequence
    views[1].prefill(torch.tensor([12, 13]))
    got = views[0].prefill(prompt).features  # a prompt: its last row
    close(got, want_prompt[-1:])
    close(views[0].forward(chain).features, want_chain)
    views[0].record_features(False)
    assert views[0].forward(torch.tensor([3])).features is None
