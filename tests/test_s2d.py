"""S2D: the sorted draft is its source model's first layers, each exit a true sub-model
(lazy deeper-layer fill gives the keys/values the full-depth model computes), the artifact
round-trips, and speculative sampling with exits stays exact end to end."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from adaspec.backends.torch.backend import TorchBackend
from adaspec.control.base import LengthController
from adaspec.core.proposal import Proposal
from adaspec.core.request import RequestState
from adaspec.core.sampling import SamplingParams
from adaspec.draft import s2d_artifact
from adaspec.draft.s2d import S2DDrafter
from adaspec.draft.sorted_model import ExitState, SortedConfig, SortedDraftLM, confidence
from adaspec.engine.loop import Engine
from adaspec.errors import InputError
from adaspec.methods.build import build_generator
from adaspec.methods.spec import parse_method
from adaspec.store.atomic import write_json

from .conftest import sampling_backend, tiny_model
from .stats_helpers import assert_caught, assert_exact
from .test_engine_sampling import V, check, first_tokens


def save_source(root, model):
    model.save_pretrained(root)
    return str(root)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random 4-layer Qwen2 with random norms (so layer order matters) and random q/k/v
    biases (a fresh model's are zero, so a draft without them would pass) on disk."""
    model = tiny_model(vocab=64, layers=4, hidden=32, seed=3, random_norms=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    return model, save_source(tmp_path_factory.mktemp("source"), model)


def test_extracted_draft_is_the_source_model_at_its_last_exit(source):
    model, path = source
    draft, record = s2d_artifact.extract(path, (2, 4))
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
        hidden = draft.exit_hidden(ids)
        logits = draft.full_logits(draft.head_logits(hidden[-1]))
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(hidden[0], ref.hidden_states[2], rtol=0, atol=1e-5)
    assert record["layers"] == 4 and len(record["sha256"]) == 64


def test_exits_beyond_the_source_are_refused(source):
    with pytest.raises(InputError, match="has 4 layers"):
        s2d_artifact.extract(source[1], (2, 6))


def _teacher_forced(draft: SortedDraftLM, ids: list[int], exit_index: int) -> torch.Tensor:
    with torch.no_grad():
        hidden = draft.exit_hidden(torch.tensor([ids]))[exit_index]
        return draft.head_logits(hidden)[0, -1]


def test_lazy_fill_matches_full_depth_through_feeds_and_rollbacks(source):
    """Random feeds with random exits and random truncations: every answer is the
    teacher-forced sub-model's logits for the prefix, so deeper layers were filled exactly."""
    draft, _ = s2d_artifact.extract(source[1], (1, 2, 4))
    state = ExitState(draft)
    rng = random.Random(0)
    seq: list[int] = []
    exits_seen = set()
    for _ in range(60):
        if seq and rng.random() < 0.2:
            keep = rng.randrange(0, len(seq))
            state.truncate(keep)
            del seq[keep:]
        new = [rng.randrange(64) for _ in range(rng.choice((1, 1, 1, 3)))]
        thresholds = tuple(rng.choice((0.0, 1.1)) for _ in range(2)) + (0.0,)
        exit_index, small = state.feed(new, thresholds)
        seq += new
        exits_seen.add(exit_index)
        expected = next(i for i, t in enumerate(thresholds) if t == 0.0)
        assert exit_index == expected
        torch.testing.assert_close(small, _teacher_forced(draft, seq, exit_index),
                                   rtol=0, atol=2e-5)
        assert state.total == len(seq) and state.done[0] == len(seq)
    assert exits_seen == {0, 1, 2}


def test_a_single_exit_runs_only_its_layers(source):
    draft, _ = s2d_artifact.extract(source[1], (2, 4))
    state = ExitState(draft, (2,))
    exit_index, small = state.feed([5, 6, 7], ())
    assert exit_index == 0 and state.layers_run == 3 * 2
    torch.testing.assert_close(small, _teacher_forced(draft, [5, 6, 7], 0), rtol=0, atol=1e-5)


def test_artifact_round_trip_keeps_trained_weights_and_refuses_other_sources(source, tmp_path):
    model, path = source
    token_ids = torch.arange(0, 64, 2)
    draft, record = s2d_artifact.extract(path, (2, 4), token_ids)
    with torch.no_grad():
        draft.layers[0].mlp.up_proj.weight.add_(0.5)  # "trained"
    s2d_artifact.save(draft, tmp_path / "art", {"source": record, "name": "t"})
    loaded, manifest = s2d_artifact.load(tmp_path / "art")
    assert manifest["kept_tokens"] == 32 and manifest["frozen"] == ["embed_tokens", "lm_head"]
    for (k, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items(),
                              strict=True):
        assert torch.equal(a, b), k
    logits = loaded.full_logits(loaded.head_logits(torch.randn(32)))
    assert torch.isinf(logits[1::2]).all() and torch.isfinite(logits[0::2]).all()
    # the frozen tensors come from the source model: other weights there are refused
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    save_source(tmp_path / "src2", model)
    manifest["source"]["name"] = str(tmp_path / "src2")
    write_json(tmp_path / "art" / "manifest.json", manifest)
    old = record["sha256"]
    new = s2d_artifact.source_files(str(tmp_path / "src2"))[1]
    with pytest.raises(InputError, match=rf"with sha256 {old[:12]}…, but that model's weights "
                                         rf"are now {new[:12]}…$"):
        s2d_artifact.load(tmp_path / "art")


def test_method_string_checks_before_loading():
    with pytest.raises(InputError, match="thresholds must be numbers"):
        parse_method("s2d:x,thresholds=0.5/high")
    with pytest.raises(InputError, match="in \\[0, 1\\]"):
        parse_method("s2d:x,thresholds=1.5")
    import adaspec.lab.bench.oracle  # noqa: F401  # why: registers the bench's ctrl=oracle

    with pytest.raises(InputError, match="ctrl=static or ctrl=heuristic"):
        parse_method("s2d:x,ctrl=oracle")
    with pytest.raises(InputError, match="no thresholds"):
        parse_method("s2d:x,exit=2,thresholds=0.5")
    assert parse_method("s2d:x,thresholds=0.5/0.7").params.threshold_values == (0.5, 0.7)


def test_missing_artifact_is_a_clear_error(tmp_path):
    with pytest.raises(InputError, match="no S2D artifact"):
        s2d_artifact.resolve(tmp_path / "nothing")


# ---------------------------------------------------------------------------------------------
# Sampling exactness: the verifier must see the q of the exit that drew the token.


class QOfLastExit(S2DDrafter):
    """Draws each token from its exit but hands the verifier the deepest exit's q."""

    def propose(self, req, max_tokens, controller):
        proposal = super().propose(req, max_tokens, controller)
        context, params = req.context, req.sampling
        if proposal.probs is None:
            return proposal
        from adaspec.core.sampling import process_logits

        # one causal pass over context + drafts: row i is the deepest exit after prefix i
        with torch.no_grad():
            hidden = self.model.exit_hidden(torch.tensor([context + proposal.tokens]))[-1]
            small = self.model.head_logits(hidden)[0, len(context) - 1 : -1]
        q = process_logits(self.model.full_logits(small), params)
        return Proposal.chain(context[-1], proposal.tokens, q,
                              forward_calls=proposal.forward_calls)


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory):
    """An 8-token target and a sorted draft from a different 4-layer model, exits 1 and 4,
    its deeper layers scaled up ("trained") so the exits disagree (mean total variation
    0.42): using the wrong exit's q is then visible."""
    root = tmp_path_factory.mktemp("s2d")
    target = tiny_model(vocab=V, seed=5, sharpen=6.0)
    src = tiny_model(vocab=V, seed=8, layers=4, sharpen=12.0, random_norms=True)
    draft, record = s2d_artifact.extract(save_source(root / "src", src), (1, 4))
    with torch.no_grad():
        for layer in draft.layers[1:]:
            layer.mlp.down_proj.weight.mul_(10.0)
    s2d_artifact.save(draft, root / "art", {"source": record, "name": "tiny"})
    return target, str(root / "art")


PARAMS = SamplingParams(1.0, top_k=6)


@pytest.mark.parametrize("broken", [None, QOfLastExit], ids=["s2d", "s2d-q-of-last-exit"])
def test_sampling_with_exits_matches_plain_decoding(sampling_pair, broken):
    target, artifact = sampling_pair
    engine = build_generator(f"s2d:{artifact},k=3,thresholds=0.45,dtype=float32",
                          sampling_backend(target), None, None, [])
    drafter = engine.drafter
    assert isinstance(drafter, S2DDrafter)
    if broken is not None:
        drafter = broken(drafter.model, (0.45,))
        engine = Engine(engine.target, None, drafter=drafter, controller=engine.controller,
                        verify=engine.verify, eos_token_ids=[])
    used: dict[str, int] = {}
    orig = drafter.propose

    def counting(*args, **kwargs):
        proposal = orig(*args, **kwargs)
        for part, n in (proposal.drafted_by or {}).items():
            used[part] = used.get(part, 0) + n
        return proposal

    drafter.propose = counting  # type: ignore[method-assign]
    cells, acceptance = first_tokens(engine, PARAMS, 5)
    fits = check(cells, target, PARAMS)
    if broken is not None:
        assert_caught(fits, "q of the last exit")
        return
    assert set(used) == {"exit 1", "exit 4"} and min(used.values()) > 300  # both exits drafted
    assert 0.05 < acceptance < 0.95
    assert_exact(fits, "s2d")


def test_greedy_s2d_equals_plain_decoding_and_reports_exit_usage(sampling_pair):
    target, artifact = sampling_pair
    backend = TorchBackend(target)
    plain = build_generator("ar", backend, None, None, [])
    s2d = build_generator(f"s2d:{artifact},k=4,thresholds=0.45,dtype=float32",
                       TorchBackend(target), None, None, [])
    exits: set[str] = set()
    for prompt in ([1, 2, 3], [4, 4, 4, 4], [7, 0, 1, 6, 2]):
        ref = plain.generate(prompt, max_new_tokens=40)
        out = s2d.generate(prompt, max_new_tokens=40)
        assert out.token_ids == ref.token_ids
        assert sum(out.stats.drafted_by.values()) == out.stats.drafted
        assert "drafted by exit" in out.stats.summary_line()
        exits |= {k for k, v in out.stats.drafted_by.items() if v}
    assert exits == {"exit 1", "exit 4"}


def test_config_checks_exits():
    with pytest.raises(ValueError, match="ascending"):
        SortedConfig(16, 8, 16, 2, 1, 1e-6, 1e4, (4, 2))


def test_prompt_runs_every_reachable_layer_at_start(source):
    """The prompt prefill is batched through every layer a token can reach; an exit whose
    threshold is 0 always answers, so the layers after it are never run at all."""
    draft, _ = s2d_artifact.extract(source[1], (1, 2, 4))
    prompt = [5, 9, 11, 3, 8]
    drafter = S2DDrafter(draft, (0.5, 0.9))
    drafter.begin(RequestState.of(prompt))
    assert drafter.state.done == [4, 4, 4] and drafter.state.layers_run == 4 * 4
    shallow = S2DDrafter(draft, (0.5, 0.0))  # exit 2 always answers: layers 3-4 unreachable
    assert shallow.state.exits == (1, 2) and shallow.thresholds == (0.5, 0.0)
    shallow.begin(RequestState.of(prompt))
    assert shallow.state.layers_run == 4 * 2


# ---------------------------------------------------------------------------------------------
# What mutation testing found unchecked (docs/mutation.md): config reading, tied heads,
# names under $ADASPEC_HOME, messages.


class _Rope:
    rope_theta = 1.0


def _hf_config(**fields):
    from types import SimpleNamespace

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                rms_norm_eps=1e-6)
    return SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize("fields, theta", [
    ({"rope_parameters": {"rope_theta": 1e6}}, 1e6),  # transformers 5: only here
    ({"rope_parameters": {"rope_theta": 1e6}, "rope_theta": 5.0}, 1e6),  # it wins
    ({"rope_parameters": {"rope_type": "default"}, "rope_theta": 5e5}, 5e5),
    ({"rope_parameters": None, "rope_theta": 5e5}, 5e5),
    ({"rope_theta": 5e5}, 5e5),  # older transformers: only the attribute
    ({}, 10000.0),  # neither: the Qwen2/Llama default
    ({"rope_parameters": _Rope(), "rope_theta": 5e5}, 5e5),  # not a dict: not read
])
def test_rope_theta_is_read_where_the_config_keeps_it(fields, theta):
    cfg = SortedConfig.from_hf(_hf_config(num_key_value_heads=2, **fields), (1, 2))
    assert cfg.rope_theta == theta and isinstance(cfg.rope_theta, float)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.exits) == (4, 2, (1, 2))


def test_kv_heads_default_to_the_attention_heads():
    assert SortedConfig.from_hf(_hf_config(), (2,)).num_kv_heads == 4


def test_a_tied_source_gives_its_embeddings_as_the_head(tmp_path):
    """A tied model stores no lm_head tensor: the draft's head is the embedding matrix, and
    the artifact records it so a load reads the same."""
    model = tiny_model(vocab=64, layers=2, hidden=32, seed=5, tie=True, random_norms=True)
    path = save_source(tmp_path / "src", model)
    token_ids = torch.arange(0, 64, 2)
    draft, record = s2d_artifact.extract(path, (1, 2), token_ids)
    assert record["tied_head"] is True and record["weights"] == "model.safetensors"
    torch.testing.assert_close(draft.lm_head.weight,
                               model.model.embed_tokens.weight[token_ids], rtol=0, atol=0)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits[0, :, token_ids]
        got = draft.head_logits(draft.exit_hidden(ids)[-1])[0]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    s2d_artifact.save(draft, tmp_path / "art", {"source": record, "name": "t"})
    loaded, _ = s2d_artifact.load(tmp_path / "art")
    assert torch.equal(loaded.lm_head.weight, draft.lm_head.weight)


def test_an_artifact_is_found_by_name_under_adaspec_home(source, tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    draft, record = s2d_artifact.extract(source[1], (2, 4))
    # save makes the missing parents (home/s2d/ does not exist yet)
    folder = s2d_artifact.save(draft, s2d_artifact.s2d_home() / "mine",
                               {"source": record, "name": "mine"})
    assert folder == tmp_path / "home" / "s2d" / "mine"
    assert s2d_artifact.resolve("mine") == folder
    loaded, manifest = s2d_artifact.load("mine")
    assert manifest["name"] == "mine" and loaded.config.exits == (2, 4)


def test_the_refusal_names_the_deepest_exit_asked_for(source):
    with pytest.raises(InputError, match=r"the exits \[1, 5, 9\] ask for 9$"):
        s2d_artifact.extract(source[1], (1, 5, 9))


class StopAfter(LengthController):
    """Drafts up to k tokens, stops after position `stop` (None: never); records its calls."""

    def __init__(self, k: int, stop: int | None) -> None:
        self.k, self.stop, self.calls = k, stop, []

    def max_tokens(self) -> int:
        return self.k

    def draft_numbers(self, draft_logits):
        self.calls.append((None, draft_logits))  # the drafter's logits, where the draft ran
        return draft_logits[:0].float()

    def decide(self, position, numbers):
        self.calls[-1] = (position, self.calls[-1][1])
        return position != self.stop


def _exit_rule(draft: SortedDraftLM, ids: list[int], thresholds) -> tuple[int, torch.Tensor]:
    """The teacher-forced answer: the first exit confident enough, else the last."""
    with torch.no_grad():
        for e, h in enumerate(draft.exit_hidden(torch.tensor([ids]))):
            small = draft.head_logits(h)[0, -1]
            if e == len(thresholds) - 1 or confidence(small) >= thresholds[e]:
                return e, draft.full_logits(small)
    raise AssertionError


def test_proposals_follow_the_exit_rule_through_accepts_and_rejections(source):
    """Greedy proposals over 30 steps of random acceptance (all, none, some, each followed
    by a correction), k and early stops: every token is the teacher-forced exit rule's, the
    controller sees each position's full logits, and the exits are counted per proposal."""
    draft, _ = s2d_artifact.extract(source[1], (1, 2, 4))
    thresholds = (0.5, 0.5)
    drafter = S2DDrafter(draft, thresholds)
    rng = random.Random(1)
    context = [rng.randrange(64) for _ in range(6)]
    drafter.begin(RequestState.of(context))
    exits_seen: Counter = Counter()
    for _ in range(30):
        k = rng.choice((1, 3, 4))
        controller = StopAfter(k, rng.choice((None, None, 0, 1)))
        proposal = drafter.propose(RequestState.of(list(context), SamplingParams(0.0)),
                                   k, controller)
        tokens = proposal.tokens
        n = k if controller.stop is None else min(k, controller.stop + 1)
        assert len(tokens) == n and proposal.forward_calls == n and proposal.probs is None
        assert [i for i, _ in controller.calls] == list(range(n))
        expected_by: Counter = Counter()
        for i, token in enumerate(tokens):
            e, logits = _exit_rule(draft, context + tokens[:i], (*thresholds, 0.0))
            expected_by[f"exit {(1, 2, 4)[e]}"] += 1
            assert token == int(logits.argmax())
            torch.testing.assert_close(controller.calls[i][1], logits, rtol=0, atol=1e-4)
        assert proposal.drafted_by == dict(expected_by)
        exits_seen.update(expected_by)
        m = rng.randrange(0, n + 1)
        correction = (tokens[m] + 1) % 64 if m < n else rng.randrange(64)
        context += tokens[:m] + [correction]
        drafter.commit(RequestState.of(context), list(range(m + 1)))
    assert set(exits_seen) == {"exit 1", "exit 2", "exit 4"}


def test_sampled_proposals_draw_with_the_generator_and_return_each_exits_distribution(source):
    draft, _ = s2d_artifact.extract(source[1], (1, 4))
    params = SamplingParams(1.0)
    drafts = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)  # only the request's generator may decide the draws
        drafter = S2DDrafter(draft, (0.5,))
        drafter.begin(RequestState.of([3, 1, 4, 1, 5]))
        req = RequestState.of([3, 1, 4, 1, 5], params, torch.Generator().manual_seed(7))
        proposal = drafter.propose(req, 4, StopAfter(4, None))
        drafts.append(proposal.tokens)
        context = [3, 1, 4, 1, 5]
        for i, token in enumerate(proposal.tokens):
            _, logits = _exit_rule(draft, context, (0.5, 0.0))
            torch.testing.assert_close(proposal.probs[i], torch.softmax(logits, -1),
                                       rtol=0, atol=1e-5)
            context = context + [token]
    assert drafts[0] == drafts[1]


@pytest.mark.parametrize("weights, dtype, linear", [
    ("bfloat16", torch.bfloat16, torch.nn.Linear),
    ("float32", torch.float32, torch.nn.Linear),
    ("int8", torch.bfloat16, "Int8WeightLinear"),
    ("int4", torch.bfloat16, "Int4WeightLinear"),
])
def test_drafting_weights_are_the_ones_asked_for(tmp_path, weights, dtype, linear):
    wide = tiny_model(vocab=64, layers=2, hidden=128, seed=4, random_norms=True)  # int4: 128
    draft, record = s2d_artifact.extract(save_source(tmp_path / "src", wide), (1, 2))
    s2d_artifact.save(draft, tmp_path / "art", {"source": record, "name": "t"})
    model, manifest = s2d_artifact.load_for_drafting(tmp_path / "art", weights)
    assert manifest["name"] == "t" and not model.training
    assert model.embed_tokens.weight.dtype == dtype
    proj = model.layers[0].mlp.up_proj
    assert (type(proj) is linear) if isinstance(linear, type) else type(proj).__name__ == linear
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        want = draft.head_logits(draft.exit_hidden(ids)[-1])
        got = model.head_logits(model.exit_hidden(ids)[-1])
    assert got.dtype == dtype  # the rotary tables follow the activations' dtype
    exit_index, small = ExitState(model).feed([1, 2, 3, 4, 5], (1.1,))  # incremental: same
    assert exit_index == 1 and small.dtype == dtype
    torch.testing.assert_close(small.float(), got[0, -1].float(), rtol=0, atol=1e-3)
    share = {"float32": 1e-6, "bfloat16": 0.03, "int8": 0.06, "int4": 0.3}[weights]
    torch.testing.assert_close(got.float(), want, rtol=0, atol=share * float(want.abs().max()))


def test_drafting_weights_default_to_bfloat16(source, tmp_path):
    draft, record = s2d_artifact.extract(source[1], (2, 4))
    s2d_artifact.save(draft, tmp_path / "art", {"source": record, "name": "t"})
    model, _ = s2d_artifact.load_for_drafting(tmp_path / "art")
    assert model.embed_tokens.weight.dtype == torch.bfloat16


def test_unknown_drafting_weights_are_refused(source, tmp_path):
    with pytest.raises(InputError, match="unknown sorted-draft weights 'fp8'"):
        s2d_artifact.load_for_drafting(tmp_path, "fp8")


def test_tuned_settings_are_found_per_target():
    manifest = {"thresholds": {"big": {"thresholds": [0.4], "k": 3}}}
    assert s2d_artifact.tuned_for(manifest, "big") == {"thresholds": [0.4], "k": 3}
    assert s2d_artifact.tuned_for(manifest, "other") is None
    assert s2d_artifact.tuned_for({"thresholds": None}, "big") is None
    assert s2d_artifact.tuned_for({}, "big") is None


def test_thresholds_must_match_the_exits(source):
    draft, _ = s2d_artifact.extract(source[1], (1, 2, 4))
    with pytest.raises(ValueError, match=r"^3 exits need 2 thresholds \(the last exit always "
                                         r"answers\), got 1$"):
        S2DDrafter(draft, (0.5,))


@pytest.mark.parametrize("exits", [(1, 3), (4, 2), (2, 2)])
def test_an_exit_state_takes_only_ascending_exits_of_its_model(source, exits):
    draft, _ = s2d_artifact.extract(source[1], (1, 2, 4))
    with pytest.raises(ValueError, match=rf"^exits \[{', '.join(map(str, exits))}\] are not "
                                         r"ascending exits of the model \(\[1, 2, 4\]\)$"):
        ExitState(draft, exits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_logits_put_kept_tokens_in_place_and_minus_inf_elsewhere(source, dtype):
    token_ids = torch.tensor([3, 10, 11, 40])
    draft, _ = s2d_artifact.extract(source[1], (2, 4), token_ids, dtype=dtype)
    assert {p.dtype for p in draft.parameters()} == {dtype}
    small = torch.arange(2 * 3 * 4, dtype=dtype).reshape(2, 3, 4)  # batched rows too
    full = draft.full_logits(small)
    assert full.shape == (2, 3, 64) and full.dtype == torch.float32
    torch.testing.assert_close(full[..., token_ids], small.float(), rtol=0, atol=0)
    rest = torch.ones(64, dtype=torch.bool)
    rest[token_ids] = False
    assert bool(torch.isneginf(full[..., rest]).all())


def test_a_source_missing_a_layer_tensor_is_named(source, tmp_path):
    from safetensors.torch import load_file, save_file

    model, path = source
    folder = tmp_path / "broken"
    model.save_pretrained(folder)
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"has no tensor 'model.layers.1.mlp.up_proj.weight': "
                                         r"not a Qwen2-style model$"):
        s2d_artifact.extract(str(folder), (1, 2))


def test_a_source_folder_needs_exactly_one_weights_file(source, tmp_path):
    source[0].save_pretrained(tmp_path / "two")
    (tmp_path / "two" / "extra.safetensors").write_bytes(b"")
    with pytest.raises(InputError, match=r"expected one \.safetensors file in .*two, found 2$"):
        s2d_artifact.source_files(str(tmp_path / "two"))


@pytest.mark.parametrize("change, message", [
    ({"format": "other"}, "is not an S2D artifact of version 1$"),
    ({"version": 2}, "is not an S2D artifact of version 1$"),
    (None, "cannot read the S2D manifest .*manifest.json: "),
])
def test_a_manifest_of_another_kind_is_refused(tmp_path, change, message):
    folder = tmp_path / "art"
    folder.mkdir()
    if change is None:
        (folder / "manifest.json").write_text("{torn")
    else:
        write_json(folder / "manifest.json", {"format": "adaspec-s2d", "version": 1, **change})
    with pytest.raises(InputError, match=message):
        s2d_artifact.read_manifest(folder)


def test_a_built_in_source_is_read_from_its_bf16_cache_quietly(source, tmp_path, monkeypatch,
                                                                capfd):
    """An artifact pins the sha256 of the source's bfloat16 safetensors cache, so a built-in
    name is prepared in bfloat16 (another dtype would be another file), without progress
    bars (extraction and loading report their own)."""
    from adaspec.store import loading

    asked = []

    def fake_prepare(name, dtype="bfloat16", *, progress=None, **kw):
        asked.append((name, dtype, progress))
        return loading.PrepareResult(name, "bfloat16", Path(source[1]), None, True)

    monkeypatch.setattr(loading, "prepare", fake_prepare)
    weights, sha, config = s2d_artifact.source_files("qwen-like")
    assert asked == [("qwen-like", "bfloat16", False)]
    assert weights == Path(source[1]) / "model.safetensors" and len(sha) == 64
    assert config.num_hidden_layers == 4
    assert capfd.readouterr().err == ""


def test_config_shapes_must_divide():
    with pytest.raises(ValueError, match="^hidden_size must divide into heads, heads into kv "
                                         "heads$"):
        SortedConfig(64, 30, 16, 4, 2, 1e-6, 1e4, (1,))  # 30 % 4
    with pytest.raises(ValueError, match="heads into kv heads"):
        SortedConfig(64, 32, 16, 4, 3, 1e-6, 1e4, (1,))  # 4 % 3
    assert SortedConfig(64, 32, 16, 4, 2, 1e-6, 1e4, (1,)).head_dim == 8


@pytest.mark.parametrize("ids", [[], [-1, 3], [0, 1, 70], [70], [0, 64]])
def test_kept_tokens_must_be_a_non_empty_subset_of_the_vocabulary(ids):
    cfg = SortedConfig(64, 32, 16, 4, 2, 1e-6, 1e4, (1,))
    with pytest.raises(ValueError, match=r"^token ids must be a non-empty subset of \[0, 64\)$"):
        SortedDraftLM(cfg, torch.tensor(ids, dtype=torch.long))


def test_one_kept_token_is_a_valid_head():
    cfg = SortedConfig(64, 32, 16, 4, 2, 1e-6, 1e4, (1,))
    model = SortedDraftLM(cfg, torch.tensor([63, 63]))
    assert model.token_ids.tolist() == [63] and model.restricted


def test_the_sorted_draft_runs_on_the_targets_device(sampling_pair):
    """On a GPU the sorted draft drafts where the target verifies: built beside a target on
    `meta` (standing in for `cuda`; it checks every operand's device and holds no data),
    its weights go there and its passes make their tokens and positions there too."""
    target, artifact = sampling_pair
    backend = TorchBackend(target)
    backend.device = "meta"
    engine = build_generator(f"s2d:{artifact},k=3,thresholds=0.45,dtype=float32",
                          backend, None, None, [])
    drafter = engine.drafter
    assert isinstance(drafter, S2DDrafter)
    assert drafter.model.device.type == "meta"
    drafter.state.append([1, 2, 3, 4], full_depth=True)  # every segment: a device mix raises
    drafter.state.append([5])  # the first segment only: the others' inputs wait
    assert drafter.state.total == 5
