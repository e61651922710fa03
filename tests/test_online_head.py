"""Online learning of the draft head (OSD on the head, issue 66; `online/head.py`): a served
request's record is the target's own states and distributions at its positions, learning
from served requests raises the head's acceptance, a learned head reaches the engines built
after it is published (never the answers: they stay the target's), a probe keeps a worse
head out, and a saved head is read back at the next start."""

from __future__ import annotations

import pytest
import torch

from adaspec.backends.torch.backend import TorchBackend
from adaspec.draft import head_artifact
from adaspec.draft.head_model import DraftHead, HeadConfig
from adaspec.lab.head import data as head_data
from adaspec.methods.build import build_generator
from adaspec.online.head import HeadLearner, HeadRecorder
from adaspec.online.head_service import OnlineHead
from adaspec.online.service import OnlineConfig

from .conftest import tiny_model


def _untrained(tmp_path):
    model = tiny_model(vocab=40, hidden=32, seed=3)
    torch.manual_seed(0)
    path = tmp_path / "head.pt"
    head_artifact.save(path, DraftHead(HeadConfig.from_target(model.config, 48)),
                       torch.arange(40), {"trained_on": ["nothing"]})
    return model, f"head:k=2,artifact={path},weights=fp32"


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 40, (5,), generator=g).tolist() for _ in range(n)]


def test_a_request_record_is_the_targets_states_and_distributions(tmp_path):
    model, method = _untrained(tmp_path)
    engine = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
    recorder = HeadRecorder(top_k=4)
    prompt = [5, 9, 11, 3, 7]
    result = engine.generate(prompt, 14, recorder=recorder)
    row = recorder.take(result.token_ids)
    tokens = prompt + result.token_ids
    tap = head_data.FeatureTap(model, ())
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0]
        final = tap.outputs["final"][0]
    finally:
        tap.close()
    start = len(prompt)  # the first verification's root: the first generated token
    n = len(row["tokens"])
    assert row["tokens"].tolist() == tokens[start : start + n] and n >= len(tokens) - start - 1
    torch.testing.assert_close(row["final"], final[start : start + n].float(), atol=1e-4,
                               rtol=1e-4)
    assert row["top_ids"][:, 0].tolist() == logits[start : start + n].argmax(-1).tolist()
    # greedy: each position's top token is the token after it
    assert row["top_ids"][:-1, 0].tolist() == row["tokens"][1:].tolist()
    assert row["prompt_len"] == 0 and row["top_probs"].shape == (n, 4)


def _acceptance(method: str, model, prompts: list[list[int]], plain) -> float:
    accepted = drafted = 0
    for p in prompts:
        got = build_generator(method, TorchBackend(model), None,
                              eos_token_ids=[]).generate(p, 16)
        assert got.token_ids == plain.generate(p, 16).token_ids  # answers stay the target's
        accepted += got.stats.accepted
        drafted += got.stats.drafted
    return accepted / max(1, drafted)


def _serve(online: OnlineHead, method: str, model, prompts: list[list[int]], plain) -> None:
    """Requests as a server runs them: an engine each (built with the head published so
    far), recorded, handed over when done."""
    for p in prompts:
        engine = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
        recorder = online.new_recorder()
        got = engine.generate(p, 16, recorder=recorder)
        assert got.token_ids == plain.generate(p, 16).token_ids
        online.after_request(recorder.take(got.token_ids))
        online.collect(wait=True)


def test_served_requests_teach_the_head_and_engines_built_later_draft_with_it(tmp_path):
    model, method = _untrained(tmp_path)
    plain = build_generator("ar", TorchBackend(model), None, eos_token_ids=[])
    held = _prompts(6, seed=99)
    before = _acceptance(method, model, held, plain)
    first = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
    cfg = OnlineConfig(interval=4, probe=2, head_lr=1e-2,
                       root=str(tmp_path / "heads"), nice=0)
    online = OnlineHead(cfg, first.drafter, first.target, "tiny")
    try:
        _serve(online, method, model, _prompts(48, seed=1), plain)
        status = online.status()
        assert status["learned"] == 48 and status["published"] >= 1
        later = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
        assert later.drafter.head is online.serving is not first.drafter.head
        after = _acceptance(method, model, held, plain)  # requests it never learned from
        assert after > before + 0.15, (before, after)
        assert online.file.is_file()
    finally:
        online.close()
    # the next start reads the saved head back and publishes it
    again = OnlineHead(cfg, first.drafter, first.target, "tiny")
    try:
        resumed = dict(again.serving.state_dict())
        saved = head_artifact.load(online.file).state
        for name, value in saved.items():
            torch.testing.assert_close(resumed[name].float(), value.float())
    finally:
        again.close()


def test_a_head_the_probe_finds_worse_is_not_published(tmp_path, monkeypatch):
    model, method = _untrained(tmp_path)
    plain = build_generator("ar", TorchBackend(model), None, eos_token_ids=[])
    first = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
    cfg = OnlineConfig(interval=2, probe=2, head_lr=1e-2, save=False,
                       nice=0)
    online = OnlineHead(cfg, first.drafter, first.target, "tiny")
    try:
        _serve(online, method, model, _prompts(32, seed=1), plain)  # learns: published
        published = online.status()["published"]
        assert published >= 1
        real_learn = HeadLearner.learn

        def damaging(self, row):  # an update that wrecks the head
            out = real_learn(self, row)
            with torch.no_grad():
                for p in self.student.parameters():
                    p.copy_(torch.randn_like(p) * 3)
            return out

        monkeypatch.setattr(HeadLearner, "learn", damaging)
        serving = online.serving
        _serve(online, method, model, _prompts(8, seed=2), plain)
        status = online.status()
        assert status["rejected"] >= 1 and status["published"] == published
        assert online.serving is serving  # the good head still serves
    finally:
        online.close()


@pytest.mark.parametrize("domains", ["shared", "field"])
def test_serve_learns_the_head_between_requests_and_answers_stay_exact(model_dirs, tmp_path,
                                                                       domains):
    """`adaspec serve --online-distill` with a head method: the server records its requests,
    learns and publishes in the background (/health says so; with `--osd-domains field`,
    per request domain), and answers stay the target's."""

    pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")
    import httpx
    from transformers import AutoConfig

    from adaspec.backends.load import load_backends
    from adaspec.serve.config import ServeConfig
    from adaspec.serve.instance import ModelInstance

    from .test_serve import health, live_server, wait_until

    target_dir, _ = model_dirs
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.from_target(AutoConfig.from_pretrained(target_dir), 48))
    path = tmp_path / "head.pt"
    target, tokenizer, _, eos = load_backends(target_dir, None, "float32", "none", "none")
    head_artifact.save(path, head, torch.arange(target.vocab_size), {"trained_on": []})
    method = f"head:k=2,artifact={path},weights=fp32"
    inst = ModelInstance(target, tokenizer, None, eos, method)
    prompts = ["def add(a, b):", "class Point:", "The weather today is", "Once upon a time"]
    plain = {p: inst.engine("ar").generate(p, 10, chat=False).text for p in prompts}
    cfg = OnlineConfig(interval=2, head_lr=1e-2, root=str(tmp_path / "h"),
                       tolerance=1.0, nice=0, domains=domains)
    inst.start_online(ServeConfig(method=method, target=target_dir, online=cfg))
    try:
        with live_server(inst) as base:
            for _ in range(3):
                for p in prompts:
                    r = httpx.post(base + "/v1/completions", json={
                        "model": "tiny", "prompt": p, "max_tokens": 10, "temperature": 0,
                        "domain": "code" if p[:1] in "cd" else "story"}, timeout=60)
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["text"] == plain[p]
            wait_until(lambda: health(base)["online_distillation"]["published"] >= 1, 120)
            status = health(base)["online_distillation"]
            assert status["kind"] == "draft head" and status["learned"] >= 2
            if domains == "field":  # each domain learned from its own requests
                learned = {d: v["learned"] for d, v in status["domains"].items()}
                wait_until(lambda: sum(health(base)["online_distillation"]["domains"][d]
                                       ["learned"] for d in ("code", "story")) == 12, 120)
                assert set(learned) >= {"code", "story"} and learned.get("default", 0) == 0
    finally:
        inst.close()


def _row(model, tokens: list[int]) -> dict:
    """A served request's record over `tokens` (greedy: each label the target's choice)."""
    tap = head_data.FeatureTap(model, ())
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0]
        final = tap.outputs["final"][0].float()
    finally:
        tap.close()
    probs, ids = torch.softmax(logits.float(), -1).topk(4, -1)
    return {"tokens": torch.tensor(tokens), "final": final, "top_ids": ids, "top_probs": probs,
            "prompt_len": 0}


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


def test_the_kept_tokens_grow_with_what_the_target_chooses_and_the_head_learns_them():
    from adaspec.draft.head_loss import Frozen, kept_index
    from adaspec.online.head import HeadLearnConfig

    model = tiny_model(vocab=40, hidden=32, seed=3)
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.from_target(model.config, 48))
    out = model.get_output_embeddings().weight.detach().float()
    rows = [_row(model, _greedy(model, p, 24)) for p in _prompts(40, seed=5)]
    chosen = torch.cat([r["top_ids"][:, 0] for r in rows])
    # the shipped set: the target's tokens it chooses least, so most of its choices lie out
    counts = torch.bincount(chosen, minlength=40)
    shipped = torch.sort(torch.argsort(counts)[:20]).values
    outside = int((kept_index(shipped, 40)[chosen] < 0).sum())
    assert outside > len(chosen) / 2

    def frozen_for(ids: torch.Tensor) -> Frozen:
        from adaspec.draft.head_model import TokenHead

        return Frozen(model.get_input_embeddings().weight.detach().float(),
                      TokenHead(out[ids].clone(), ids, 40), kept_index(ids, 40))

    def stream(grow: int) -> tuple[HeadLearner, float]:
        learner = HeadLearner(head, frozen_for(shipped), HeadLearnConfig(
            lr=1e-2, grow=grow, grow_min=2, bf16=False), rows=lambda ids: out[ids])
        for r in rows[:32]:
            learner.learn(r)
        hits = [learner.agreement(r)[0] for r in rows[32:]]  # never learned from
        return learner, sum(a for a, _ in hits) / sum(b for _, b in hits)

    grown, with_growth = stream(grow=12)
    ids = grown.frozen.token_head.token_ids
    assert 20 < len(ids) <= 32 and torch.equal(ids, torch.sort(ids).values)
    assert set(shipped.tolist()) <= set(ids.tolist())
    # a joined token's row is the target's own output row, its index where the loss reads
    torch.testing.assert_close(grown.frozen.token_head.proj.weight, out[ids])
    assert torch.equal(grown.frozen.index[ids], torch.arange(len(ids)))
    # the negative control: the shipped set, learned the same way, cannot reach the tokens
    # outside it
    fixed, without = stream(grow=0)
    assert len(fixed.frozen.token_head.token_ids) == 20
    assert with_growth > without + 0.2, (with_growth, without)


def test_a_server_publishes_the_grown_kept_set_and_reads_it_back(tmp_path):
    from adaspec.draft.head import HeadDrafter

    model = tiny_model(vocab=40, hidden=32, seed=3)
    torch.manual_seed(0)
    plain = build_generator("ar", TorchBackend(model), None, eos_token_ids=[])
    served = _prompts(24, seed=1)
    chosen = torch.tensor([t for p in served for t in plain.generate(p, 16).token_ids])
    shipped = torch.sort(torch.argsort(torch.bincount(chosen, minlength=40))[:20]).values
    path = tmp_path / "head.pt"
    head_artifact.save(path, DraftHead(HeadConfig.from_target(model.config, 48)), shipped,
                       {"trained_on": ["nothing"]})
    method = f"head:k=2,artifact={path},weights=fp32"
    first = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
    cfg = OnlineConfig(interval=4, probe=2, head_lr=1e-2, head_grow=12,
                       root=str(tmp_path / "heads"), nice=0, tolerance=1.0)
    online = OnlineHead(cfg, first.drafter, first.target, "tiny")
    out = model.get_output_embeddings().weight.detach().float()
    try:
        _serve(online, method, model, served, plain)  # answers stay the target's
        assert online.status()["published"] >= 1
        later = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
        drafter = later.drafter
        assert isinstance(drafter, HeadDrafter) and drafter.head is online.serving
        ids = drafter.tokens.token_ids
        assert 20 < len(ids) <= 32 and set(shipped.tolist()) <= set(ids.tolist())
        torch.testing.assert_close(drafter.tokens.proj.weight.float(), out[ids])
        assert torch.equal(head_artifact.load(online.file).token_ids, ids)
    finally:
        online.close()
    again = OnlineHead(cfg, first.drafter, first.target, "tiny")  # the next start
    try:
        assert torch.equal(again.learner.frozen.token_head.token_ids, ids)
        engine = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
        assert torch.equal(engine.drafter.tokens.token_ids, ids)
    finally:
        again.close()


def test_each_domain_learns_its_own_head_and_its_requests_draft_with_it(tmp_path):
    """`--osd-domains field`: a domain's requests teach its own head, which its later
    requests draft with; another domain keeps the shipped head; a restart reads each
    domain's head back. Answers stay the target's throughout."""
    from adaspec.online.head_service import head_drafter

    model, method = _untrained(tmp_path)
    plain = build_generator("ar", TorchBackend(model), None, eos_token_ids=[])
    first = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
    cfg = OnlineConfig(interval=4, probe=2, head_lr=1e-2, domains="field",
                       root=str(tmp_path / "heads"), nice=0)

    def served(online: OnlineHead, domain: str, prompts: list[list[int]],
               learn: bool = True) -> float:
        accepted = drafted = 0
        for p in prompts:
            engine = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
            online.prepare(engine, online.domain(domain, p))
            recorder = online.new_recorder()
            got = engine.generate(p, 16, recorder=recorder)
            assert got.token_ids == plain.generate(p, 16).token_ids
            accepted, drafted = accepted + got.stats.accepted, drafted + got.stats.drafted
            if learn:
                online.after_request(recorder.take(got.token_ids, domain))
                online.collect(wait=True)
        return accepted / max(1, drafted)

    online = OnlineHead(cfg, first.drafter, first.target, "tiny")
    held = _prompts(6, seed=99)  # never learned from
    try:
        served(online, "fr", _prompts(40, seed=1))
        status = online.status()["domains"]
        assert status["fr"]["learned"] == 40 and status["fr"]["published"] >= 1
        assert status["default"]["learned"] == 0 and status["default"]["published"] == 0
        fr, other = (build_generator(method, TorchBackend(model), None, eos_token_ids=[])
                     for _ in range(2))
        online.prepare(fr, "fr")
        online.prepare(other, "code")
        assert head_drafter(fr).head is online.domains["fr"].serving
        assert head_drafter(other).head is online.shipped_head  # a domain never served
        learned = served(online, "fr", held, learn=False)
        shipped = served(online, "code", held, learn=False)
        assert learned > shipped + 0.15, (shipped, learned)
    finally:
        online.close()
    again = OnlineHead(cfg, first.drafter, first.target, "tiny")  # the next start
    try:
        assert again.domains["fr"].serving is not None
        restored = again.domains["fr"].published_float.state_dict()
        saved = head_artifact.load(online.domains["fr"].file).state
        for name, value in saved.items():
            torch.testing.assert_close(restored[name].float(), value.float())
    finally:
        again.close()


def test_a_learned_head_worse_than_the_shipped_one_is_not_published(tmp_path):
    """The probe bounds what is served by the shipped head too: a learned head ahead of the
    serving one (itself drifted) but behind the shipped one stays unpublished."""
    model, method = _untrained(tmp_path)
    first = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
    cfg = OnlineConfig(interval=4, probe=2, head_lr=1e-2, save=False, nice=0)
    online = OnlineHead(cfg, first.drafter, first.target, "tiny")
    try:
        domain = online.domains["default"]
        # per request: (learned, serving, shipped, positions) agreements
        domain.probe.extend([(30, 20, 40, 100)] * 4)
        online._publish(domain)
        assert domain.rejected == 1 and domain.published == 0
        assert online.serving is online.shipped_head
        domain.probe.clear()
        domain.probe.extend([(30, 20, 25, 100)] * 4)  # ahead of both: published
        online._publish(domain)
        assert domain.published == 1 and online.serving is not online.shipped_head
    finally:
        online.close()


@pytest.mark.parametrize("backoff", [4, 1])
def test_learning_that_gains_nothing_backs_off(tmp_path, monkeypatch, backoff):
    """Publications refused while the learned head is no better than the shipped one
    (traffic it already knows) make the learner take one request in 2, then 4; backoff=1
    (the control) learns from every request."""
    model, method = _untrained(tmp_path)
    plain = build_generator("ar", TorchBackend(model), None, eos_token_ids=[])
    first = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
    monkeypatch.setattr(HeadLearner, "learn", lambda self, row: 0.0)  # learns nothing
    # a tolerance below any agreement: every publication is refused
    cfg = OnlineConfig(interval=2, probe=2, head_lr=1e-2, save=False, nice=0,
                       tolerance=-2.0, head_backoff=backoff)
    online = OnlineHead(cfg, first.drafter, first.target, "tiny")
    try:
        _serve(online, method, model, _prompts(24, seed=1), plain)
        status = online.status()
        assert status["published"] == 0 and status["rejected"] >= 1
        assert status["learned"] + status["skipped"] == 24
        if backoff == 1:
            assert status["skipped"] == 0
        else:  # 2 learned, refused; 1 in 2 for 4, refused again; then 1 in 4
            assert status["learned"] <= 10 and status["skipped"] >= 14, status
    finally:
        online.close()


def test_learning_that_gains_is_not_backed_off_when_refused(tmp_path):
    """A learned head far ahead of the shipped one, refused (here by the tolerance), is
    still learning the traffic: it keeps learning from every request."""
    model, method = _untrained(tmp_path)
    plain = build_generator("ar", TorchBackend(model), None, eos_token_ids=[])
    first = build_generator(method, TorchBackend(model), None, eos_token_ids=[])
    cfg = OnlineConfig(interval=2, probe=2, head_lr=1e-2, save=False, nice=0,
                       tolerance=-2.0, head_backoff=4)
    online = OnlineHead(cfg, first.drafter, first.target, "tiny")
    try:
        _serve(online, method, model, _prompts(24, seed=1), plain)
        status = online.status()
        # (at most a request let go after the first refusal, while the head had learned
        # from 2 requests only: against 14 or more where learning gains nothing, above)
        assert status["rejected"] >= 4 and status["skipped"] <= 2 and status["learned"] >= 22
        assert status["probe_agreement"]["learned"] > status["probe_agreement"]["shipped"]
    finally:
        online.close()


def test_a_publication_made_again_ends_the_back_off():
    from adaspec.online.head_service import DomainHead

    domain = DomainHead.__new__(DomainHead)
    domain.arrived = domain.skipped = domain.stale = 0
    assert all(domain.learns_from_next(4) for _ in range(8))
    domain.stale = 1
    assert [domain.learns_from_next(4) for _ in range(4)] == [False, True, False, True]
    domain.stale = 5
    assert sum(domain.learns_from_next(4) for _ in range(16)) == 4  # capped at 1 in 4
    domain.stale = 0  # published again
    assert all(domain.learns_from_next(4) for _ in range(8))


@pytest.mark.parametrize("flag, value", [("--osd-head-backoff", "0"), ("--osd-head-lr", "0"),
                                         ("--osd-head-grow", "-1"), ("--interval", "0")])
def test_a_bad_online_setting_is_an_error_naming_its_option(flag, value):
    import argparse

    from adaspec.cli.serve import add_online_options
    from adaspec.errors import InputError
    from adaspec.online.options import online_config

    parser = argparse.ArgumentParser()
    add_online_options(parser)
    with pytest.raises(InputError, match=f"^{flag} must "):
        online_config(parser.parse_args([flag, value]))
