"""The draft head's layer in ik_llama.cpp (`head:weights=ggml`): the one-block GGUF computes
what the torch head computes (the rope's pair order mended at export, or the positions part
them; head size 16 and up: ik_llama.cpp's attention gets a head of 8 wrong), and the drafter
keeps its cache to the accepted positions, so it drafts what the torch head drafts while its
output stays the target's."""

from __future__ import annotations

import pytest
import torch

import adaspec.backends.ik.backend as ikllama

from .conftest import tiny_model
from .test_head import _head, _trained_head_drafter, assert_exact_and_drafting


def _has_features() -> bool:
    if not ikllama.available():
        return False
    return ikllama.target_features(ikllama.library())


pytestmark = pytest.mark.skipif(not _has_features(),
                                reason="needs the ik_llama.cpp library `adaspec runtime build` "
                                       "makes (its target-features patch)")


def _outputs(head, rows: torch.Tensor, tmp_path):
    """The GGUF head's last final-normed state and kept-token logits after feeding fc's
    outputs `rows` [T, H] at positions 0 .. T - 1."""
    from adaspec.backends.ik.head_graph import GgmlHead, export

    path = tmp_path / "head.gguf"
    out_rows = torch.randn(40, head.cfg.hidden, generator=torch.Generator().manual_seed(1))
    export(head.cfg, head.state_dict(), out_rows, path)
    model = GgmlHead(path, head.cfg.hidden)
    ctx = model.acquire()
    try:
        state, logits = ctx.decode(rows, list(range(len(rows))))
    finally:
        model.release(ctx)
    return state[0, 0], logits, out_rows


@pytest.mark.parametrize("permuted", [True, False], ids=["export", "rope-pairs-not-mended"])
def test_the_gguf_head_computes_what_the_torch_head_computes(tmp_path, monkeypatch, permuted):
    from adaspec.backends.ik import head_graph

    if not permuted:  # the negative control: q and k rows left in Qwen2's half order
        monkeypatch.setattr(head_graph, "_permute", lambda w, heads: w)
    model = tiny_model(vocab=40, hidden=64)
    head = _head(model)
    g = torch.Generator().manual_seed(2)
    feats, embeds = torch.randn(1, 9, 64, generator=g), torch.randn(1, 9, 64, generator=g)
    with torch.no_grad():
        want, _ = head(feats, embeds, torch.arange(9)[None])
        rows = head.fc(torch.cat([feats, embeds], -1))[0]
    state, logits, out_rows = _outputs(head, rows, tmp_path)
    close = torch.allclose(state, want[0, -1], atol=0.05, rtol=0.02)
    assert close == permuted
    if permuted:
        torch.testing.assert_close(logits, out_rows @ want[0, -1], atol=0.1, rtol=0.02)


def _spy(engine) -> list[list[int]]:
    """The list every proposal's tokens of `engine`'s drafter are appended to from now on."""
    seen: list[list[int]] = []
    propose = engine.drafter.propose

    def spy(req, max_tokens, controller):
        proposal = propose(req, max_tokens, controller)
        seen.append(list(proposal.tokens))
        return proposal

    engine.drafter.propose = spy
    return seen


def _drafts(engine, prompts) -> list[list[int]]:
    """Every proposal's tokens over greedy generations of `prompts`."""
    seen = _spy(engine)
    for prompt in prompts:
        engine.generate(prompt, max_new_tokens=16)
    return seen


@pytest.mark.parametrize("removes", [True, False], ids=["head", "chains-left-in-cache"])
def test_the_ggml_drafter_drafts_what_the_torch_head_drafts_and_stays_exact(
        tmp_path, monkeypatch, removes):
    """Greedy output is plain decoding's, and the proposals are the fp32 head's, step by
    step (chains of 3 leave their drafted positions in the context until the next step
    removes them: left there, the head reads them and drafts otherwise)."""
    from adaspec.backends.ik import head_graph
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.draft import head_artifact
    from adaspec.draft.head_ggml import GgmlHeadDrafter
    from adaspec.methods.build import build_generator

    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    model = tiny_model(vocab=40, hidden=64, seed=3)
    path = tmp_path / "head.pt"
    head_artifact.save(path, _trained_head_drafter(model).head, torch.arange(40), {})
    prompts = ([5, 9, 11, 3], [7, 7, 20, 31, 2, 8])
    engines = {w: build_generator(f"head:k=3,artifact={path},weights={w}", TorchBackend(model),
                                  None, eos_token_ids=[]) for w in ("fp32", "ggml")}
    assert isinstance(engines["ggml"].drafter, GgmlHeadDrafter)
    assert list((tmp_path / "home" / "heads" / "ggml").glob("*.gguf"))  # exported, cached
    if removes:
        assert_exact_and_drafting(engines["ggml"], model)
    else:
        monkeypatch.setattr(head_graph.HeadContext, "remove_from", lambda self, position: None)
    want, got = (_drafts(engines[w], prompts) for w in ("fp32", "ggml"))
    assert len(want) > 10
    same = sum(a == b for a, b in zip(got, want, strict=False))
    assert (len(got) == len(want) and same >= len(want) - 1) == removes


def test_online_learning_publishes_to_the_ggml_head(tmp_path, monkeypatch):
    """A head learned online reaches ggml drafters built afterwards: exported and loaded at
    publication, its model scores what the published torch head scores."""
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.draft import head_artifact
    from adaspec.methods.build import build_generator
    from adaspec.online.head_service import OnlineHead
    from adaspec.online.service import OnlineConfig

    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    model = tiny_model(vocab=40, hidden=64, seed=3)
    path = tmp_path / "head.pt"
    head_artifact.save(path, _head(model), torch.arange(40), {})
    method = f"head:k=2,artifact={path},weights=ggml"
    first = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
    cfg = OnlineConfig(interval=4, probe=2, tolerance=1.0, head_lr=1e-2, save=False, nice=0)
    online = OnlineHead(cfg, first.drafter, first.target, "tiny")
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(16):
            engine = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
            recorder = online.new_recorder()
            prompt = torch.randint(1, 40, (5,), generator=g).tolist()
            got = engine.generate(prompt, 16, recorder=recorder)
            online.after_request(recorder.take(got.token_ids))
            online.collect(wait=True)
        assert online.status()["published"] >= 1
        later = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
        assert later.drafter.head is online.serving is not first.drafter.head
        assert later.drafter.runner is not first.drafter.runner
        feats = torch.randn(3, 64, generator=g)
        rows = later.drafter.rows(feats, [4, 9, 17])
        with torch.no_grad():
            want, _ = online.serving(feats.to(torch.bfloat16)[None],
                                     later.drafter._embeds([4, 9, 17]), torch.arange(3)[None])
        ctx = later.drafter.runner.acquire()
        try:
            state, _ = ctx.decode(rows, [0, 1, 2])
        finally:
            later.drafter.runner.release(ctx)
        torch.testing.assert_close(state[0, 0], want[0, -1].float(), atol=0.08, rtol=0.05)
        # a published head's export is loaded, not kept: on disk only the file's head's
        # (a server publishing every few requests wrote 21 MB each time, for good)
        assert len(list((tmp_path / "home" / "heads" / "ggml").glob("*.gguf"))) == 1
        # a head nothing drafts with any more is freed with its model (weakly held)
        import gc

        from adaspec.backends.ik import head_graph

        del later, engine
        gc.collect()
        mine = [k for k in head_graph._MODELS if k.startswith(str(tmp_path))]
        assert online.status()["published"] >= 3 and len(mine) <= 2  # the file's, the last
    finally:
        online.close()


def test_the_default_weights_are_ggml_where_the_target_runs_in_ik_llama_cpp():
    from adaspec.draft.head_ggml import default_weights

    class Target:
        kind = "ik_llama-native-fa-regions-narrow+child"

    assert default_weights(Target()) == "ggml"
    Target.kind = "torch"
    assert default_weights(Target()) == "int8"


def test_a_full_head_cache_stops_the_head_not_the_request(tmp_path, monkeypatch):
    """A context of 8 positions (32 cells, as ik_llama.cpp rounds it) fills within the
    request: the head drafts no more (or repeats itself), the request goes on, its output
    plain decoding's."""
    from adaspec.backends.ik import head_graph
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.draft import head_artifact
    from adaspec.methods.build import build_generator

    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(head_graph, "CONTEXT", 8)
    model = tiny_model(vocab=40, hidden=64, seed=3)
    path = tmp_path / "head.pt"
    head_artifact.save(path, _trained_head_drafter(model).head, torch.arange(40), {})
    engine = build_generator(f"head:k=3,artifact={path},weights=ggml", TorchBackend(model),
                             None, eos_token_ids=[])
    plain = build_generator("ar", TorchBackend(model), None, eos_token_ids=[])
    prompt = [5, 9, 11, 3]
    got = engine.generate(prompt, max_new_tokens=64)  # past the 32 cells the context rounds 8 to
    assert got.token_ids == plain.generate(prompt, max_new_tokens=64).token_ids


@pytest.mark.parametrize("apart", [True, False], ids=["sequences", "one-sequence-for-all"])
def test_drafters_sharing_a_context_keep_their_caches_apart(tmp_path, monkeypatch, apart):
    """Two requests' drafters hold two sequences of one context; decoded together (their
    steps interleaved round by round, as a server runs them), each proposes what the fp32
    torch head proposes alone (negative control: both handed the same sequence, each reads
    and removes the other's positions)."""
    from adaspec.backends.ik import head_graph
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.draft import head_artifact
    from adaspec.methods.build import build_generator

    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    if not apart:
        real = head_graph.GgmlHead.acquire

        def same_sequence(self):
            ctx = real(self)
            ctx.seq = 0
            return ctx

        monkeypatch.setattr(head_graph.GgmlHead, "acquire", same_sequence)
    model = tiny_model(vocab=40, hidden=64, seed=3)
    path = tmp_path / "head.pt"
    head_artifact.save(path, _trained_head_drafter(model).head, torch.arange(40), {})

    def engine(weights: str):
        return build_generator(f"head:k=3,artifact={path},weights={weights}",
                               TorchBackend(model), None, eos_token_ids=[])

    from adaspec.engine.batch import BatchDecoder

    from .test_batch import run_together

    targets = TorchBackend(model).sequences(2)
    engines = [build_generator(f"head:k=3,artifact={path},weights=ggml", t, None,
                               eos_token_ids=[]) for t in targets]
    assert engines[0].drafter.cache._shared is engines[1].drafter.cache._shared
    seen = [_spy(e) for e in engines]
    prompts = ([5, 9, 11, 3], [7, 7, 20, 31, 2, 8])
    requests = {i: e.stream_steps(p, max_new_tokens=16)
                for i, (e, p) in enumerate(zip(engines, prompts, strict=True))}
    run_together(BatchDecoder(cost=None), requests)  # their steps interleaved, round by round
    want = [_drafts(engine("fp32"), [p]) for p in prompts]
    assert all(len(w) > 4 for w in want)
    same = seen == want
    assert same == apart


def test_a_domains_ggml_head_serves_its_requests_and_the_shipped_one_the_others(tmp_path,
                                                                                  monkeypatch):
    """`--osd-domains field` on the ggml head: a domain's published head reaches the
    requests of that domain (the drafter switches model and cache), another domain's
    requests keep the shipped head's model, and every answer is plain decoding's."""
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.draft import head_artifact
    from adaspec.methods.build import build_generator
    from adaspec.online.head_service import OnlineHead, head_drafter
    from adaspec.online.service import OnlineConfig

    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    model = tiny_model(vocab=40, hidden=64, seed=3)
    path = tmp_path / "head.pt"
    head_artifact.save(path, _head(model), torch.arange(40), {})
    method = f"head:k=2,artifact={path},weights=ggml"
    plain = build_generator("ar", TorchBackend(model), None, eos_token_ids=[])
    first = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
    cfg = OnlineConfig(interval=4, probe=2, tolerance=1.0, head_lr=1e-2, save=False, nice=0,
                       domains="field")
    online = OnlineHead(cfg, first.drafter, first.target, "tiny")
    g = torch.Generator().manual_seed(1)

    def serve(domain: str) -> object:
        engine = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
        online.prepare(engine, online.domain(domain, []))
        recorder = online.new_recorder()
        prompt = torch.randint(1, 40, (5,), generator=g).tolist()
        got = engine.generate(prompt, 16, recorder=recorder)
        assert got.token_ids == plain.generate(prompt, 16).token_ids
        online.after_request(recorder.take(got.token_ids, domain))
        online.collect(wait=True)
        return engine

    try:
        for _ in range(12):
            serve("fr")
        assert online.status()["domains"]["fr"]["published"] >= 1
        fr = head_drafter(serve("fr"))
        assert fr.head is online.domains["fr"].serving
        assert fr.runner is not first.drafter.runner
        other = head_drafter(serve("code"))  # a domain not published yet: the shipped head
        assert other.head is online.shipped_head and other.runner is first.drafter.runner
    finally:
        online.close()
