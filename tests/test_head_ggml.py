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
    ctx = GgmlHead(path, head.cfg.hidden).acquire()
    try:
        state, logits = ctx.decode(rows, list(range(len(rows))))
    finally:
        ctx.close()
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


def _drafts(engine, prompts) -> list[list[int]]:
    """Every proposal's tokens over greedy generations of `prompts`."""
    seen: list[list[int]] = []
    propose = engine.drafter.propose

    def spy(req, max_tokens, controller):
        proposal = propose(req, max_tokens, controller)
        seen.append(list(proposal.tokens))
        return proposal

    engine.drafter.propose = spy
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


def test_online_learning_refuses_a_ggml_head(tmp_path):
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.draft import head_artifact
    from adaspec.errors import InputError
    from adaspec.methods.build import build_generator
    from adaspec.online.head import OnlineHead
    from adaspec.online.service import OnlineConfig

    model = tiny_model(vocab=40, hidden=64, seed=3)
    path = tmp_path / "head.pt"
    head_artifact.save(path, _head(model), torch.arange(40), {})
    engine = build_generator(f"head:artifact={path},weights=ggml", TorchBackend(model), None,
                             eos_token_ids=[])
    with pytest.raises(InputError, match="weights=ggml"):
        OnlineHead(OnlineConfig(root=str(tmp_path)), engine.drafter, engine.target, "tiny")
