"""The draft head's model and its training (issue 65): the cache gives what a full pass gives,
the unrolled training steps see what drafting after earlier drafts sees, and training on a
tiny target's features teaches the head its next tokens."""

from __future__ import annotations

import pytest
import torch

from adaspec.draft.head_model import DraftHead, HeadConfig
from adaspec.lab.head import data as head_data
from adaspec.lab.head import train as head_train

from .conftest import sampling_backend, tiny_model


def _rows(model, n: int, length: int, seed: int) -> list[dict]:
    """Recorded rows as `head_data.collect` writes them, over random token sequences."""
    g = torch.Generator().manual_seed(seed)
    picks = head_data.layer_picks(model.config.num_hidden_layers)
    picks = tuple(min(max(p, 0), model.config.num_hidden_layers - 1) for p in picks)
    tap = head_data.FeatureTap(model, picks)
    rows = []
    try:
        for _ in range(n):
            ids = torch.randint(3, model.config.vocab_size, (length,), generator=g)
            with torch.no_grad():
                logits = model(ids[None]).logits[0].float()
            top_p, top_i = torch.softmax(logits, -1).topk(4, -1)
            rows.append({"tokens": ids.to(torch.int32), "prompt_len": 1,
                         "final": tap.outputs["final"][0].clone(),
                         "layers": torch.stack([tap.outputs[f"layer{i}"][0] for i in picks], 1),
                         "top_ids": top_i.to(torch.int32), "top_probs": top_p})
    finally:
        tap.close()
    return rows


def _head(model, features: int = 1) -> DraftHead:
    torch.manual_seed(0)
    return DraftHead(HeadConfig.from_target(model.config, 48, features)).eval()


def test_the_heads_cache_gives_what_a_full_pass_gives():
    model = tiny_model(vocab=40, hidden=32)
    head = _head(model)
    x, e = torch.randn(1, 7, 32), torch.randn(1, 7, 32)
    pos = torch.arange(7)[None]
    with torch.no_grad():
        full, _ = head(x, e, pos)
        first, kv = head(x[:, :4], e[:, :4], pos[:, :4])
        rest, _ = head(x[:, 4:], e[:, 4:], pos[:, 4:], past=kv)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, atol=1e-5, rtol=1e-5)


def test_an_unrolled_step_is_a_draft_after_the_earlier_ones():
    """Depth 2 at index i: the cache holds indices 0..i-1 from the target's features, and
    index i is fed with the head's own depth-1 output at i - 1; depth 3 feeds one more."""
    model = tiny_model(vocab=40, hidden=32)
    rows = _rows(model, 1, 9, seed=1)
    head = _head(model)
    frozen = head_train.frozen_parts(model, torch.arange(40))
    cfg = head_train.TrainConfig(depth=3)
    with torch.no_grad():
        outs = head_train.unrolled(head, frozen, rows[0], cfg, 3)
        feats = rows[0]["final"].float()
        emb = frozen.embed[rows[0]["tokens"].long()[1:]].float()
        for i in (3, 6):
            _, kv = head(feats[None, :i - 1], emb[None, :i - 1], torch.arange(i - 1)[None])
            h1, kv = head(feats[None, i - 1:i], emb[None, i - 1:i],
                          torch.tensor([[i - 1]]), past=kv)
            h2, kv = head(h1, emb[None, i:i + 1], torch.tensor([[i]]), past=kv)
            h3, _ = head(h2, emb[None, i + 1:i + 2], torch.tensor([[i + 1]]), past=kv)
            torch.testing.assert_close(outs[0][i - 1], h1[0, 0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(outs[1][i], h2[0, 0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(outs[2][i + 1], h3[0, 0], atol=1e-5, rtol=1e-5)
    # negative control: a depth-2 step that saw the target's own feature at i is another step
    with torch.no_grad():
        _, kv = head(feats[None, :3], emb[None, :3], torch.arange(3)[None])
        cheat, _ = head(feats[None, 3:4], emb[None, 3:4], torch.tensor([[3]]), past=kv)
    assert not torch.allclose(outs[1][3], cheat[0, 0], atol=1e-3)


def test_training_teaches_the_head_the_targets_next_tokens():
    model = tiny_model(vocab=40, hidden=32, seed=3)
    rows, held = _rows(model, 160, 24, seed=4), _rows(model, 16, 24, seed=5)
    frozen = head_train.frozen_parts(model, torch.arange(40))
    head = _head(model).train()
    cfg = head_train.TrainConfig(depth=2, epochs=3, lr=1e-2, log_every=1000)
    before = head_train.evaluate(head, frozen, held, cfg, 2)
    report = head_train.train(head, frozen, rows, held, cfg, progress=False)
    # held-out answers: about 0.04 by chance before, 0.7 after (seeded, so fixed)
    assert report.held_out[0] > before[0] + 0.4
    assert report.held_out[1] > before[1] + 0.4


def _trained_head_drafter(model, vocab_kept: int | None = None):
    """A head trained on the tiny target's own greedy continuations (so it drafts some of
    them right), as a HeadDrafter over the target's embeddings and output rows."""
    from adaspec.draft.head import HeadDrafter

    rows = _rows(model, 160, 24, seed=4)
    kept = torch.arange(model.config.vocab_size) if vocab_kept is None else \
        head_train.kept_tokens(rows, vocab_kept, model.config.vocab_size, [0])
    frozen = head_train.frozen_parts(model, kept)
    head = _head(model).train()
    head_train.train(head, frozen, rows, [], head_train.TrainConfig(depth=2, epochs=3, lr=1e-2,
                                                                     log_every=1000),
                     progress=False)
    return HeadDrafter(head.eval(), frozen.token_head, frozen.embed)


@pytest.mark.parametrize("runtime", ["torch", "static", "static-fixed"])
def test_greedy_decoding_with_the_head_is_plain_decoding_and_drafts_get_accepted(runtime):
    """On each torch runtime (the static one returns its features from the pass, at exact
    shapes and at the fixed ones a GPU replays)."""
    from adaspec.control.static import StaticLength
    from adaspec.engine.loop import Engine

    from .conftest import runtime_backend

    model = tiny_model(vocab=40, hidden=32, seed=3)
    drafter = _trained_head_drafter(model)
    plain = Engine(runtime_backend(runtime, model, "plain"), None, eos_token_ids=[])
    engine = Engine(runtime_backend(runtime, model, "head"), None, drafter=drafter,
                    controller=StaticLength(3), eos_token_ids=[])
    accepted = drafted = 0
    for prompt in ([5, 9, 11, 3], [7, 7, 20, 31, 2, 8], [30]):
        want = plain.generate(prompt, max_new_tokens=20).token_ids
        got = engine.generate(prompt, max_new_tokens=20)
        assert got.token_ids == want
        accepted += got.stats.accepted
        drafted += got.stats.drafted
        # head steps are counted apart from draft model passes (priced apart)
        assert got.stats.head_calls >= got.stats.drafted > 0 and got.stats.draft_calls == 0
    assert drafted > 0 and accepted / drafted > 0.3


def test_the_head_needs_a_runtime_that_gives_features():
    from adaspec.control.static import StaticLength
    from adaspec.engine.loop import Engine
    from adaspec.errors import InputError

    class NoFeatures:
        kind = "plain"
        max_context = 64
        has_features = False
        vocab_size = 40

    model = tiny_model(vocab=40, hidden=32, seed=3)
    frozen = head_train.frozen_parts(model, torch.arange(40))
    from adaspec.draft.head import HeadDrafter

    drafter = HeadDrafter(_head(model), frozen.token_head, frozen.embed)
    with pytest.raises(InputError, match="reads the target's features"):
        Engine(NoFeatures(), None, drafter=drafter, controller=StaticLength(2),  # type: ignore[arg-type]
               eos_token_ids=[])


class Unrenormalised:
    """A head drafter that draws from its kept-set distribution but hands the verifier that
    distribution scaled by the mass the kept set had over the full vocabulary (q not
    renormalised over the kept set): the negative control."""

    def __new__(cls, base):
        from adaspec.draft.head import HeadDrafter

        class Drafter(HeadDrafter):
            name = "head-unrenormalised"

            def propose(self, req, max_tokens, controller):
                proposal = super().propose(req, max_tokens, controller)
                if proposal.probs is not None:
                    proposal.probs = proposal.probs * 0.55  # the kept set's mass, say
                return proposal

        return Drafter(base.head, base.tokens, base.embed)


@pytest.mark.parametrize("broken", [False, True], ids=["head", "head-q-not-renormalised"])
def test_sampling_with_a_restricted_head_follows_the_target_law(broken):
    """At T > 0 the head's q is zero outside its kept tokens and renormalised over them:
    speculative sampling then emits the target's law exactly (chi-square on the first three
    tokens, `test_engine_sampling`); handing the verifier an unrenormalised q must fail."""
    from adaspec.control.static import StaticLength
    from adaspec.core.sampling import SamplingParams
    from adaspec.draft.head import HeadDrafter
    from adaspec.engine.loop import Engine

    from .stats_helpers import assert_caught, assert_exact
    from .test_engine_sampling import check, first_tokens

    model = tiny_model(vocab=8, seed=5, sharpen=6.0)
    frozen = head_train.frozen_parts(model, torch.tensor([0, 2, 3, 5, 6]))  # 5 of 8 kept
    drafter = HeadDrafter(_head(model), frozen.token_head, frozen.embed)
    if broken:
        drafter = Unrenormalised(drafter)
    # the static runtime's features (`sampling_backend`): the same law, in less time
    engine = Engine(sampling_backend(model), None, drafter=drafter, controller=StaticLength(3),
                    eos_token_ids=[])
    params = SamplingParams(1.0, top_k=6)
    cells, acceptance = first_tokens(engine, params, 5)
    fits = check(cells, model, params)
    if broken:
        assert_caught(fits, "q not renormalised over the kept set")
        return
    assert 0.05 < acceptance < 0.95
    assert_exact(fits, "head")


def test_the_head_method_loads_an_artifact_and_decodes_what_plain_decoding_does(tmp_path):
    """`head:artifact=PATH` builds the drafter from a saved head and the target's own
    embeddings and output rows; its greedy output is the target's."""
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.draft import head_artifact
    from adaspec.methods.build import build_generator

    model = tiny_model(vocab=40, hidden=32, seed=3)
    drafter = _trained_head_drafter(model)
    path = tmp_path / "head.pt"
    head_artifact.save(path, drafter.head, torch.arange(40), {"trained_on": ["tiny"]})
    engine = build_generator(f"head:k=3,artifact={path}", TorchBackend(model), None,
                          eos_token_ids=[])
    assert_exact_and_drafting(engine, model)


def assert_exact_and_drafting(engine, model) -> None:
    """The engine's greedy output is plain decoding's on two prompts, and it drafted."""
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.methods.build import build_generator

    plain = build_generator("ar", TorchBackend(model), None, eos_token_ids=[])
    drafted = 0
    for prompt in ([5, 9, 11, 3], [7, 7, 20, 31, 2, 8]):
        got = engine.generate(prompt, max_new_tokens=16)
        assert got.token_ids == plain.generate(prompt, max_new_tokens=16).token_ids
        drafted += got.stats.drafted
    assert drafted > 0


@pytest.mark.parametrize("weights", ["bf16", "int8", "int8-dyn"])
def test_the_head_method_runs_its_weights_as_asked_and_stays_exact(tmp_path, weights):
    """weights=int8 keeps int8 rows with bf16 activations (weight-only), int8-dyn quantizes
    the activations too; either way the output is the target's."""
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.draft import head_artifact
    from adaspec.methods.build import build_generator
    from adaspec.store.quant import Int8DynamicLinear, Int8WeightLinear

    model = tiny_model(vocab=40, hidden=32, seed=3)
    path = tmp_path / "head.pt"
    head_artifact.save(path, _trained_head_drafter(model).head, torch.arange(40), {})
    engine = build_generator(f"head:k=3,artifact={path},weights={weights}", TorchBackend(model),
                          None, eos_token_ids=[])
    drafter = engine.drafter
    kinds = {type(m) for m in [*drafter.head.modules(), *drafter.tokens.modules()]}
    expected = {"bf16": None, "int8": Int8WeightLinear, "int8-dyn": Int8DynamicLinear}[weights]
    if expected is None:
        assert next(drafter.head.parameters()).dtype == torch.bfloat16
    else:
        assert expected in kinds
        # q/k/v and gate/up stay one product each, quantized too
        assert {type(m) for m in drafter.head.layer.fused.values()} == {expected}
    plain = build_generator("ar", TorchBackend(model), None, eos_token_ids=[])
    prompt = [5, 9, 11, 3]
    got = engine.generate(prompt, max_new_tokens=16)
    assert got.token_ids == plain.generate(prompt, max_new_tokens=16).token_ids
    assert got.stats.drafted > 0


def test_the_head_method_names_the_commands_where_no_head_ships(tmp_path):
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.errors import InputError
    from adaspec.methods.build import build_generator

    model = tiny_model(vocab=40, hidden=32, seed=3)
    with pytest.raises(InputError, match="adaspec head data.*adaspec head train"):
        build_generator("head", TorchBackend(model, name="no-such-model"), None, eos_token_ids=[])
    with pytest.raises(InputError, match="draft head not found"):
        build_generator(f"head:artifact={tmp_path / 'missing.pt'}", TorchBackend(model), None,
                     eos_token_ids=[])
    with pytest.raises(InputError, match="unknown length controller 'nope'"):
        build_generator("head:ctrl=nope", TorchBackend(model), None, eos_token_ids=[])
    with pytest.raises(InputError,
                       match="weights must be one of default, fp32, bf16, int8, int8-dyn, ggml"):
        build_generator("head:weights=int4", TorchBackend(model), None, eos_token_ids=[])


def test_fewer_query_heads_than_the_target_has():
    model = tiny_model(vocab=40, hidden=32)
    cfg = HeadConfig.from_target(model.config, 48, heads=2)
    assert (cfg.heads, cfg.kv_heads) == (2, 2)
    head = DraftHead(cfg)
    out, _ = head(torch.randn(1, 3, 32), torch.randn(1, 3, 32), torch.arange(3)[None])
    assert out.shape == (1, 3, 32)
    with pytest.raises(ValueError, match="multiple"):
        HeadConfig.from_target(model.config, 48, heads=3)


def test_training_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """A run killed after its first epoch's checkpoint and started again ends where one
    uninterrupted run ends (the head, the optimizer and the schedule restored)."""
    model = tiny_model(vocab=40, hidden=32, seed=3)
    rows = _rows(model, 12, 12, seed=4)
    frozen = head_train.frozen_parts(model, torch.arange(40))
    cfg = head_train.TrainConfig(depth=2, epochs=2, lr=1e-2, log_every=1000)
    whole = _head(model).train()
    head_train.train(whole, frozen, rows, [], cfg, progress=False)

    class Killed(Exception):
        pass

    real_unrolled = head_train.unrolled
    calls = {"n": 0}

    def dies_in_the_second_epoch(*a, **k):
        calls["n"] += 1
        if calls["n"] > len(rows):
            raise Killed
        return real_unrolled(*a, **k)

    ckpt = tmp_path / "run.ckpt"
    with monkeypatch.context() as m:
        m.setattr(head_train, "unrolled", dies_in_the_second_epoch)
        with pytest.raises(Killed):
            head_train.train(_head(model).train(), frozen, rows, [], cfg, progress=False,
                             checkpoint=ckpt)
    assert torch.load(ckpt, weights_only=False)["epoch"] == 0
    resumed = _head(model).train()
    head_train.train(resumed, frozen, rows, [], cfg, progress=False, checkpoint=ckpt)
    for a, b in zip(resumed.state_dict().values(), whole.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)
    # negative control: a fresh start of the second epoch alone ends elsewhere
    fresh = _head(model).train()
    head_train.train(fresh, frozen, rows, [], head_train.TrainConfig(
        depth=2, epochs=1, lr=1e-2, log_every=1000), progress=False)
    assert not torch.allclose(fresh.fc.weight, whole.fc.weight)


@pytest.mark.parametrize("profile", ["flat", "steep"])
def test_auto_prices_the_head_as_a_source(tmp_path, profile):
    """`auto:use=ngram+head` drafts from the head where verification is nearly free and
    never where every verified token costs a whole pass; greedy output is plain decoding's
    either way."""
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.draft import head_artifact
    from adaspec.methods.build import build_generator

    from .test_auto import flat_profile, steep_profile

    model = tiny_model(vocab=40, hidden=32, seed=3)
    drafter = _trained_head_drafter(model)
    path = tmp_path / "head.pt"
    head_artifact.save(path, drafter.head, torch.arange(40), {"trained_on": ["tiny"]})
    costs = flat_profile() if profile == "flat" else steep_profile()
    # the head's step priced at 1 ms, not measured: what auto chooses must not depend on
    # how busy the machine running the test is
    engine = build_generator(f"auto:use=ngram+head,head={path},head_ms=1", TorchBackend(model),
                          None, eos_token_ids=[], profile=costs)
    plain = build_generator("ar", TorchBackend(model), None, eos_token_ids=[])
    by_head = head_calls = 0
    for prompt in ([5, 9, 11, 3], [7, 7, 20, 31, 2, 8], [30]):
        got = engine.generate(prompt, max_new_tokens=20)
        assert got.token_ids == plain.generate(prompt, max_new_tokens=20).token_ids
        by_head += engine.drafter.choices.head
        head_calls += got.stats.head_calls
        assert got.stats.draft_calls == 0  # no draft model here: every step was the head's
    if profile == "flat":
        assert by_head > 0 and head_calls >= by_head
    else:
        assert by_head == 0


@pytest.mark.parametrize("fixed", [False, True])
def test_auto_learns_what_a_head_step_costs_unless_told(tmp_path, fixed, monkeypatch):
    """Without head_ms=, auto prices a head step at what its steps take in the engine (a
    step timed alone, cache-warm, is about half that on a CPU), and a price too high to
    peek at drifts back to the step alone's; head_ms= fixes the price."""
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.draft import auto, head_artifact
    from adaspec.methods.build import build_generator

    from .test_auto import flat_profile

    ticks = iter(range(10**6))  # a fake clock: a head step (two reads) takes 5 ms
    monkeypatch.setattr(auto, "clock", lambda: 0.005 * next(ticks))
    model = tiny_model(vocab=40, hidden=32, seed=3)
    path = tmp_path / "head.pt"
    head_artifact.save(path, _trained_head_drafter(model).head, torch.arange(40), {})
    for wrong in (1e-6, 1e6):  # far below and far above what a tiny head's step takes
        price = f"head_ms={wrong}," if fixed else ""
        engine = build_generator(f"auto:use=ngram+head,head={path},{price}k_max=4",
                              TorchBackend(model), None, eos_token_ids=[],
                              profile=flat_profile())
        drafter = engine.drafter
        assert drafter.learn_head_ms is not fixed
        drafter.memory.head_ms = wrong
        engine.generate([5, 9, 11, 3], max_new_tokens=20)
        if fixed:
            assert drafter.memory.head_ms == wrong
        elif wrong < 1:
            assert 1.0 < drafter.memory.head_ms <= 5.0  # moved toward the 5 ms its steps took
        else:
            assert drafter.memory.head_ms < 0.9 * wrong  # drifting back to the step alone's price


def test_auto_with_use_head_and_no_head_says_how_to_make_one():
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.errors import InputError
    from adaspec.methods.build import build_generator

    from .test_auto import flat_profile

    model = tiny_model(vocab=40, hidden=32, seed=3)
    with pytest.raises(InputError, match="adaspec head data"):
        build_generator("auto:use=ngram+head", TorchBackend(model, name="no-such-model"), None,
                     eos_token_ids=[], profile=flat_profile())
    # the default uses the head only where one ships for the target: none for this one,
    # so it builds without (explicitly asked, the same is an error, above)
    draft = TorchBackend(tiny_model(vocab=40, hidden=32, seed=4, layers=1))
    engine = build_generator("auto", TorchBackend(model, name="no-such-model"), None, draft,
                          eos_token_ids=[], profile=flat_profile())
    assert engine.drafter.head is None
    with pytest.raises(InputError, match="add head to use="):
        build_generator("auto:use=ngram,head=x.pt", TorchBackend(model), None, eos_token_ids=[],
                     profile=flat_profile())


def test_auto_by_default_drafts_with_the_head_that_ships_for_its_target(tmp_path, monkeypatch):
    """`auto` without use= takes the head shipped for the target where the runtime returns
    the features, and its greedy output stays the target's."""
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.draft import head_artifact
    from adaspec.methods.build import build_generator

    from .test_auto import flat_profile

    model = tiny_model(vocab=40, hidden=32, seed=3)
    path = tmp_path / "head.pt"
    head_artifact.save(path, _trained_head_drafter(model).head, torch.arange(40), {})
    monkeypatch.setattr(head_artifact, "builtin_for", lambda name: path)
    draft = TorchBackend(tiny_model(vocab=40, hidden=32, seed=4, layers=1))
    engine = build_generator("auto", TorchBackend(model), None, draft, eos_token_ids=[],
                             profile=flat_profile())
    assert engine.drafter.head is not None
    plain = build_generator("ar", TorchBackend(model), None, eos_token_ids=[])
    prompt = [5, 9, 11, 3]
    assert engine.generate(prompt, max_new_tokens=16).token_ids == \
        plain.generate(prompt, max_new_tokens=16).token_ids


def test_a_fused_layer_computes_what_the_separate_products_compute():
    """`HeadLayer.fuse` (q/k/v and gate/up stacked, what the drafter runs) changes the
    number of products, not the result; `unfuse` goes back."""
    model = tiny_model(vocab=40, hidden=32)
    head = _head(model)
    x, e = torch.randn(1, 6, 32), torch.randn(1, 6, 32)
    pos = torch.arange(6)[None]
    with torch.no_grad():
        plain, (k0, v0) = head(x, e, pos)
        head.layer.fuse()
        fused, (k1, v1) = head(x, e, pos)
        one, _ = head(x[:, 5:], e[:, 5:], pos[:, 5:], past=(k1[:, :, :5], v1[:, :, :5]))
        head.layer.unfuse()
        with torch.no_grad():
            head.layer.up.weight.mul_(2.0)  # unfused: the separate weights are read again
        changed, _ = head(x, e, pos)
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k1, k0)
    torch.testing.assert_close(one[:, 0], plain[:, 5], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(changed, plain, atol=1e-3)


def test_held_out_examples_stay_held_out_as_the_recording_grows():
    """A warm start on a grown folder must not validate on examples it trained on: the
    held-out set is chosen by id, so the first folder's held-out rows are still held out."""
    from adaspec.lab.head.data import split_held

    small = [{"id": f"sharegpt/{i}"} for i in range(300)]
    grown = small + [{"id": f"wmt/{i}"} for i in range(500)]
    held_small, train_small = split_held(small, 0.05)
    held_grown, train_grown = split_held(grown, 0.05)
    assert 5 <= len(held_small) <= 30 and len(held_small) + len(train_small) == len(small)
    ids = {r["id"] for r in held_grown}
    assert {r["id"] for r in held_small} <= ids
    assert not ids & {r["id"] for r in train_grown}
    assert not ids & {r["id"] for r in train_small}  # nothing held out now was trained on


def test_engines_on_a_runtime_share_one_copy_of_the_head(tmp_path, monkeypatch):
    """A server builds a head engine per request: on a runtime that reads the target's parts
    from its file, every drafter shares one head and one embedding table (hundreds of MB for
    the built-in target), while each keeps its own request's cache; another weights mode or
    a changed file loads anew."""
    import types

    from adaspec.draft import head_artifact
    from adaspec.draft.head import HeadDrafter
    from adaspec.store.loading import cache_dir_for

    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    model = tiny_model(vocab=40, hidden=32, seed=3)
    model.save_pretrained(cache_dir_for("tiny-file"), safe_serialization=True)
    path = tmp_path / "head.pt"
    head_artifact.save(path, _trained_head_drafter(model).head, torch.arange(40), {})
    target = types.SimpleNamespace(name="tiny-file")  # no torch model: parts from the file
    a = HeadDrafter.load(path, target)
    b = HeadDrafter.load(path, target)
    assert a is not b and a.head is b.head and a.embed is b.embed and a.tokens is b.tokens
    assert torch.equal(a.embed.float(), model.get_input_embeddings().weight.float())
    a._kv = (torch.zeros(1), torch.zeros(1))
    assert b._kv is None  # the request state is each drafter's own
    assert HeadDrafter.load(path, target, "fp32").head is not a.head
    head_artifact.save(path, _trained_head_drafter(model).head, torch.arange(40), {"v": 2})
    assert HeadDrafter.load(path, target).head is not a.head  # the file changed


def test_head_engines_built_per_request_share_the_head_and_its_timing(tmp_path, monkeypatch):
    """A server builds every request an engine: on a torch target the drafters of one model
    share one head (another model gets its own), and the step is timed once per head (each
    `auto` build with a head would otherwise spend a dozen head steps on timing)."""
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.draft import head_artifact
    from adaspec.draft.head import HeadChain, HeadDrafter

    model = tiny_model(vocab=40, hidden=32, seed=3)
    path = tmp_path / "head.pt"
    head_artifact.save(path, _trained_head_drafter(model).head, torch.arange(40), {})
    a = HeadDrafter.load(path, TorchBackend(model))
    b = HeadDrafter.load(path, TorchBackend(model))
    other = HeadDrafter.load(path, TorchBackend(tiny_model(vocab=40, hidden=32, seed=3)))
    assert a is not b and a.head is b.head and a.embed is b.embed
    assert other.head is not a.head
    steps = []
    advance = HeadChain.advance
    monkeypatch.setattr(HeadChain, "advance",
                        lambda chain, token: (steps.append(token), advance(chain, token))[1])
    ms = a.step_ms()
    timed = len(steps)
    assert timed >= 12 and ms > 0
    assert b.step_ms() == ms and len(steps) == timed  # the same head: not timed again
    other.step_ms()
    assert len(steps) == 2 * timed
    a.step_ms(context=64, reps=2)  # other settings are measured, not remembered
    assert len(steps) == 2 * timed + 5


def test_a_head_draft_carries_its_confidence_as_the_acceptance_estimate():
    """A batch prices how much of a head's draft to verify by `Proposal.accept`: the head's
    top probability at each drafted token (not the batch's 0.5 default)."""
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.control.static import StaticLength
    from adaspec.core.request import RequestState

    model = tiny_model(vocab=40, hidden=32, seed=3)
    drafter = _trained_head_drafter(model)
    target = TorchBackend(model)
    target.record_features(True)
    context = [5, 9, 11, 3]
    out = target.prefill(torch.tensor(context))
    req = RequestState.of(context)
    req.keep_features(0, out.features)
    drafter.begin(req)
    proposal = drafter.propose(req, 3, StaticLength(3))
    assert proposal.accept is not None and len(proposal.accept) == len(proposal.tokens) == 3
    drafter.begin(req)  # the same step again, read token by token
    chain = drafter.open(req)
    assert chain is not None
    want = []
    for token in proposal.tokens:
        want.append(float(torch.softmax(chain.small_logits(), -1).max()))
        chain.advance(token)
    assert proposal.accept == pytest.approx(want, rel=1e-5)
    assert len(set(proposal.accept)) > 1 and all(0 < a <= 1 for a in proposal.accept)


def test_auto_engines_with_a_head_learn_together(tmp_path):
    """Two engines of `auto` with the head, each timing its own head step when built, share
    what they learn once one learns with the other (a server's slots); one without the head
    keeps its own."""
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.draft import head_artifact
    from adaspec.methods.build import build_generator

    from .test_auto import flat_profile

    model = tiny_model(vocab=40, hidden=32, seed=3)
    path = tmp_path / "head.pt"
    head_artifact.save(path, _trained_head_drafter(model).head, torch.arange(40), {})
    first, second = (build_generator(f"auto:use=ngram+head,head={path},k_max=4",
                                  TorchBackend(model), None, eos_token_ids=[],
                                  profile=flat_profile()) for _ in range(2))
    plain = build_generator("auto:use=ngram,k_max=4", TorchBackend(model), None, eos_token_ids=[],
                         profile=flat_profile())
    assert first.drafter.memory is not second.drafter.memory
    second.learn_with(first)
    plain.learn_with(first)
    assert second.drafter.memory is first.drafter.memory
    assert plain.drafter.memory is not first.drafter.memory
    first.generate([5, 9, 11, 3], max_new_tokens=12)
    assert second.drafter.memory.head_overall.trials > 0


@pytest.mark.parametrize("head,weight", [("wrong", None), ("trained", None),
                                         ("wrong", 1e12)],
                         ids=["wrong-head", "trained-head", "wrong-head-request-ignored"])
def test_auto_stops_drafting_from_a_head_its_request_finds_wrong(tmp_path, monkeypatch, head,
                                                                 weight):
    """The head's rates span requests; a request whose own head tokens keep missing scales
    them down and stops drafting from it, while a head that keeps landing keeps drafting.
    Negative control: with the request's own outcomes outweighed (a huge
    HEAD_REQUEST_WEIGHT), the wrong head keeps drafting on the cross-request rates."""
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.cost.profile import CostProfile, Curve
    from adaspec.draft import auto, head_artifact
    from adaspec.draft.rates import RateEstimate
    from adaspec.methods.build import build_generator

    if weight is not None:
        monkeypatch.setattr(auto, "HEAD_REQUEST_WEIGHT", weight)
    model = tiny_model(vocab=40, hidden=32, seed=3)
    module = _trained_head_drafter(model).head if head == "trained" else _head(model)
    path = tmp_path / "head.pt"
    head_artifact.save(path, module, torch.arange(40), {})
    sizes = list(range(1, 17))  # a verified row costs 30% of a step, as on a 2-vCPU CPU
    costs = CostProfile(target=Curve(sizes, [0], [[40.0 + 12.0 * (n - 1) for n in sizes]]))
    engine = build_generator(f"auto:use=head,head={path},head_ms=1,k_max=4",
                             TorchBackend(model), None, eos_token_ids=[], profile=costs)
    plain = build_generator("ar", TorchBackend(model), None, eos_token_ids=[])
    drafter = engine.drafter
    n = len(drafter.memory.head_rates)  # earlier requests found the head right 90% of the time
    drafter.memory.head_rates = [RateEstimate(0.9) for _ in range(n)]
    for r in drafter.memory.head_rates + [drafter.memory.head_overall]:
        r.trials, r.successes = 200.0, 180.0
    prompt = [5, 9, 11, 3, 17, 22]
    got = engine.generate(prompt, max_new_tokens=48)
    assert got.token_ids == plain.generate(prompt, max_new_tokens=48).token_ids
    steps, by_head = got.stats.target_calls, drafter.choices.head
    accepted, expected = drafter._head_outcomes
    if head == "trained":
        assert accepted / expected > 0.6 and by_head > steps / 2
    elif weight is None:
        assert accepted / expected < 0.2 and by_head <= 12
    else:
        assert by_head > steps / 2


def test_sharegpt_prompts_the_target_answers_start_where_asked(tmp_path, monkeypatch):
    """`head data --sharegpt-own N --sharegpt-own-from I`: ShareGPT prompts from file index I
    on, without their answers (the target writes its own), under ids of their own; the
    teacher-forced ones keep theirs. Past the 12,000 conversations that may train: refused."""
    import json

    from adaspec.cli import main
    from adaspec.lab.bench import suites

    convs = [{"conversations": [{"from": "human", "value": f"q{i}"},
                                {"from": "gpt", "value": f"a{i}"}]} for i in range(6)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    monkeypatch.setattr(suites, "_sharegpt_file", lambda _: path)
    got = head_data.training_examples(sharegpt=2, sharegpt_own=2, sharegpt_own_from=3)
    assert [(e.id, e.prompt, e.answer) for e in got] == [
        ("sharegpt/0", "q0", "a0"), ("sharegpt/1", "q1", "a1"),
        ("sharegpt-own/3", "q3", ""), ("sharegpt-own/4", "q4", "")]
    code = main(["head", "data", "--out", str(tmp_path / "d"), "--sharegpt-own", "5",
                 "--sharegpt-own-from", "12000"])
    assert code == 2


def test_a_users_own_prompts_are_read_and_bad_files_named(tmp_path):
    """`head data --prompts FILE`: a JSON list of strings, or JSON lines of strings or
    objects with "prompt" (and an "id"); anything else one line naming the file."""
    from adaspec.errors import InputError

    listed = tmp_path / "mine.json"
    listed.write_text('["Translate: one", "Translate: two"]')
    assert [(e.id, e.prompt, e.answer) for e in head_data.read_prompts(listed)] == [
        ("prompts/mine/0", "Translate: one", ""), ("prompts/mine/1", "Translate: two", "")]
    lines = tmp_path / "lines.jsonl"
    lines.write_text('{"id": "fr/1", "prompt": "Bonjour"}\n\n"plain"\n')
    assert [(e.id, e.prompt) for e in head_data.read_prompts(lines)] == [
        ("fr/1", "Bonjour"), ("prompts/lines/1", "plain")]
    for text, says in (('{"text": "x"}\n', "item 0 has no prompt"), ("[1, 2", "not JSON"),
                       ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n',
                        "share an id")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(InputError, match=says):
            head_data.read_prompts(bad)
    with pytest.raises(InputError, match="no such file"):
        head_data.read_prompts(tmp_path / "missing.json")


def test_the_engine_writes_the_targets_own_answers_and_a_run_resumes(tmp_path):
    """`head data` answers through adaspec's engine (greedy: plain decoding's tokens, the
    end token kept where the answer ended), appended one row a prompt, and a second run
    answers only what the first left."""
    import json

    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.methods.build import build_generator

    from .conftest import CharTokenizer

    class ChatTokenizer(CharTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
            return [3] + self.encode(messages[0]["content"]) + [4]

    model = tiny_model(vocab=40, hidden=32, seed=3)
    tokenizer = ChatTokenizer(40)
    engine = build_generator("ngram:k=3", TorchBackend(model), tokenizer, eos_token_ids=[7])
    plain = build_generator("ar", TorchBackend(model), tokenizer, eos_token_ids=[7])
    examples = [head_data.Example(f"p/{i}", "ab" + "cdef"[i] + "gh") for i in range(4)]
    out = tmp_path / "answers.jsonl"
    head_data.engine_answers(engine, examples[:2], out, 12, eos=7, progress=False)
    got = head_data.engine_answers(engine, examples, out, 12, eos=7, progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["p/0", "p/1", "p/2", "p/3"]  # none answered twice
    for ex, row in zip(got, rows, strict=True):
        ids = head_data._prompt_ids(tokenizer, ex.prompt)
        want = plain.generate(ids, 12, chat=False)
        expected = list(want.token_ids) + ([7] if want.finish_reason == "eos" and
                                           want.token_ids[-1:] != [7] else [])
        assert list(ex.answer_ids) == row["answer_ids"] == expected
    # a resumed run finds every answer kept: none to answer, so no model is loaded for it
    kept, pending = head_data.with_saved_answers(examples, out)
    assert pending == 0 and [list(e.answer_ids) for e in kept] == [r["answer_ids"]
                                                                  for r in rows]
    assert head_data.with_saved_answers(examples, tmp_path / "none.jsonl")[1] == 4
