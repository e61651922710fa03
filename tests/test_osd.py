"""Online speculative decoding (adaspec.online): the distillation losses against their
formulas, the engine's recorder against the teacher-forced replay, the bounded replay
buffers, saved adapters and their crash safety, the guard, a restart, exactness with swaps
between requests, the update worker in a child process, domains and the student's forward.

All on tiny random models (tests/conftest.py). The main draft is the target with its last
layer perturbed: it agrees with the target often enough to accept some tokens and reject
others (a random draft rejects almost everything, which would leave the guard nothing to
protect and the recorder's accepted paths untested).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

import adaspec.online.adapters as adapters_mod
from adaspec.backends.torch.backend import TorchBackend
from adaspec.control.static import StaticLength
from adaspec.draft.model import ModelDrafter
from adaspec.engine.loop import Engine
from adaspec.errors import AdaspecError, InputError
from adaspec.lab.osd.replay import chain_steps
from adaspec.online.adapters import Adapter, load_adapter, load_all, save_adapter
from adaspec.online.buffer import ReplayBuffer
from adaspec.online.distill import DistillConfig
from adaspec.online.domains import DomainChooser
from adaspec.online.losses import parse_loss
from adaspec.online.record import Recorder, RequestRecord
from adaspec.online.service import OnlineConfig, OnlineDistiller, serving_state
from adaspec.online.student import Student, apply_to_serving, trainable_names
from adaspec.online.worker import ProcessWorker, UpdateRequest, UpdateResult, WorkerSettings

from .conftest import bpe_tokenizer, tiny_model

K = 3  # the chain's draft length
MAX_NEW = 24
PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14], [1, 2], [20, 30, 40, 50, 60, 61],
           [33, 34, 35]]


# ---------------------------------------------------------------------------- helpers
def noisy_copy(model, scale: float = 0.02, seed: int = 5):
    """The target with its last decoder layer perturbed: a draft that accepts some tokens."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    last = len(out.model.layers) - 1
    with torch.no_grad():
        for name, p in out.named_parameters():
            if name.startswith(f"model.layers.{last}."):
                p.add_(scale * torch.randn(p.shape, generator=gen))
    return out


def chain_engine(target_model, draft_model) -> Engine:
    return Engine(TorchBackend(target_model, "tiny-target"), None,
                  drafter=ModelDrafter(TorchBackend(draft_model, "tiny-draft")),
                  controller=StaticLength(K), eos_token_ids=[])


def record_requests(engine: Engine, prompts, mode: str, top_k: int = 8,
                    domain: str = "default") -> list[RequestRecord]:
    recorder = Recorder(top_k=top_k, mode=mode)
    records = []
    for p in prompts:
        r = engine.generate(p, max_new_tokens=MAX_NEW, recorder=recorder)
        records.append(recorder.take(r.token_ids, domain, r.stats.drafted, r.stats.accepted))
    return records


def tensors(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def distiller(cfg: OnlineConfig, draft_model, wait: bool = True) -> OnlineDistiller:
    """An in-process distiller serving `draft_model` (changed in place by swaps)."""
    student = Student(copy.deepcopy(draft_model), cfg.layers)
    return OnlineDistiller(cfg, draft_model, "tiny-draft", in_process=True, wait=wait,
                           student=student)


def feed(svc: OnlineDistiller, records, domain: str = "default") -> None:
    """Finished requests, as `domain`'s (copies: a buffer may cut a record in place)."""
    for r in records:
        svc.after_request(dataclasses.replace(r, domain=domain))


def poisoned(record: RequestRecord, gen: torch.Generator, vocab: int) -> RequestRecord:
    """The same positions, with the 'target' sure of random tokens."""
    ids = torch.randint(0, vocab, record.top_ids.shape, generator=gen)
    probs = torch.zeros(record.top_probs.shape)
    probs[:, 0] = 0.99
    return RequestRecord(record.tokens, record.prompt_len, list(record.positions), ids, probs,
                         record.domain)


@pytest.fixture(scope="module")
def target_m():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def draft_m(target_m):
    return noisy_copy(target_m)


@pytest.fixture(scope="module")
def records(target_m, draft_m):
    """Real records ('all' mode: every verified position) of PROMPTS, with the base draft."""
    return record_requests(chain_engine(target_m, copy.deepcopy(draft_m)), PROMPTS, "all")


# ---------------------------------------------------------------------------- 1. losses
def _kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per row, over all outcomes (a > 0 everywhere here)."""
    return (a * (a.log() - b.log())).sum(-1)


def _pair(rows: int = 6, vocab: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(2.5 * torch.randn(rows, vocab, generator=gen, dtype=torch.float64), -1)
    q_logits = 2.5 * torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    return p, q_logits


def _formulas(p: torch.Tensor, q: torch.Tensor, beta: float) -> dict[str, torch.Tensor]:
    m = beta * p + (1 - beta) * q
    return {"fkl": _kl(p, q).mean(), "rkl": _kl(q, p).mean(),
            f"jsd:{beta}": (beta * _kl(p, m) + (1 - beta) * _kl(q, m)).mean()}


def test_losses_equal_their_formulas_when_top_k_is_the_whole_vocabulary():
    p, q_logits = _pair()
    logq = torch.log_softmax(q_logits, -1)
    q = logq.exp()
    # every token recorded, in a scrambled order (the loss must follow the ids)
    gen = torch.Generator().manual_seed(1)
    top_ids = torch.stack([torch.randperm(p.shape[1], generator=gen) for _ in range(len(p))])
    top_probs = p.gather(-1, top_ids)
    for beta in (0.3, 0.5, 0.8):
        for text, expected in _formulas(p, q, beta).items():
            got = parse_loss(text)(logq, top_ids, top_probs)
            assert float(expected) > 1e-3
            assert float(got) == pytest.approx(float(expected), rel=1e-9, abs=1e-12), text


def test_coarse_losses_merge_the_tail_and_never_exceed_the_full_ones():
    p, q_logits = _pair(seed=3)
    logq = torch.log_softmax(q_logits, -1)
    q = logq.exp()
    for k in (1, 4, 9):
        top_probs, top_ids = torch.topk(p, k, -1)
        q_top = q.gather(-1, top_ids)
        # the same divergences over k + 1 outcomes: the k tokens and "any other"
        p2 = torch.cat([top_probs, 1 - top_probs.sum(-1, keepdim=True)], -1)
        q2 = torch.cat([q_top, 1 - q_top.sum(-1, keepdim=True)], -1)
        for beta in (0.3, 0.5):
            full = _formulas(p, q, beta)
            merged = _formulas(p2, q2, beta)
            for text in full:
                got = float(parse_loss(text)(logq, top_ids, top_probs))
                assert got == pytest.approx(float(merged[text]), rel=1e-9, abs=1e-12), (k, text)
                assert 0 < got <= float(full[text]) + 1e-12, (k, text)


def test_forward_and_reverse_kl_differ_on_an_asymmetric_pair():
    p = torch.tensor([[0.90, 0.05, 0.05]], dtype=torch.float64)
    logq = torch.tensor([[0.4, 0.3, 0.3]], dtype=torch.float64).log()
    ids = torch.tensor([[0, 1, 2]])
    fkl = float(parse_loss("fkl")(logq, ids, p))
    rkl = float(parse_loss("rkl")(logq, ids, p))
    assert fkl > 0 and rkl > 0
    assert abs(fkl - rkl) > 0.05
    # jsd's beta is its own: two betas give two values, and "jsd" is beta 0.5
    assert parse_loss("jsd").beta == 0.5
    assert float(parse_loss("jsd:0.2")(logq, ids, p)) != float(parse_loss("jsd:0.7")(logq, ids, p))


@pytest.mark.parametrize("text", ["jsd:1.5", "jsd:0", "jsd:x", "kl", "fkl:0.2", "rkl:1"])
def test_parse_loss_rejects_bad_names_and_parameters(text):
    with pytest.raises(InputError):
        parse_loss(text)
    with pytest.raises(InputError):
        DistillConfig(loss=text)


# ---------------------------------------------------------------------------- 2. recorder
@pytest.mark.parametrize("mode", ["rejected", "all"])
@pytest.mark.parametrize("draft_kind", ["noisy", "random"])
def test_recorder_matches_the_teacher_forced_replay(target_m, draft_m, mode, draft_kind):
    # The replay's guesses come from one batched forward of the draft, the engine's drafts
    # from its KV cache step by step: in float32 they can differ in the last bits. These
    # seeds and prompts have no near-tie at any argmax, so the two agree exactly.
    draft = copy.deepcopy(draft_m) if draft_kind == "noisy" else tiny_model(seed=1, layers=2)
    engine = chain_engine(target_m, draft)
    student = Student(copy.deepcopy(draft), 1)
    recorder = Recorder(top_k=8, mode=mode)
    totals = [0, 0, 0]  # accepted, rejected steps, full steps
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=MAX_NEW, recorder=recorder)
        output = result.token_ids
        assert len(output) == MAX_NEW
        record = recorder.take(output, "d", result.stats.drafted, result.stats.accepted)
        tokens = prompt + output
        guesses = student.predictions(tokens, len(prompt)).tolist()
        replay = chain_steps(guesses, output, K, MAX_NEW, mode)
        assert (replay.drafted, replay.accepted) == (result.stats.drafted,
                                                     result.stats.accepted)
        assert replay.steps == result.stats.steps
        assert record.positions == [len(prompt) + i for i in replay.rows]
        assert record.tokens == tokens and record.prompt_len == len(prompt)
        assert (record.domain, record.drafted, record.accepted) == (
            "d", result.stats.drafted, result.stats.accepted)
        assert record.top_ids.shape == record.top_probs.shape == (len(record), 8)
        if record.positions:
            # greedy: the emitted token at every recorded position is the target's top token
            emitted = torch.tensor([tokens[p] for p in record.positions])
            assert torch.equal(record.top_ids[:, 0], emitted)
            # position p holds the target's distribution of tokens[p] given tokens[:p]
            with torch.no_grad():
                logits = target_m(torch.tensor([tokens])).logits[0]
            probs = torch.softmax(logits.float(), -1)[[p - 1 for p in record.positions]]
            expected, expected_ids = torch.topk(probs, 8, -1)
            assert torch.equal(record.top_ids, expected_ids)
            torch.testing.assert_close(record.top_probs, expected, atol=1e-5, rtol=1e-4)
        totals[0] += result.stats.accepted
        totals[1] += sum(a < d for d, a in result.stats.steps)
        totals[2] += sum(a == d for d, a in result.stats.steps)
    assert totals[1] > 0
    if draft_kind == "noisy":  # accepted tokens and fully accepted steps both happened
        assert totals[0] > 10 and totals[2] > 0


def test_recorder_skips_requests_that_drafted_nothing_and_rejects_bad_settings(target_m):
    engine = Engine(TorchBackend(target_m, "t"), None, eos_token_ids=[])
    recorder = Recorder(top_k=4, mode="all")
    result = engine.generate([3, 4, 5], max_new_tokens=6, recorder=recorder)
    record = recorder.take(result.token_ids)
    assert len(record) == 0 and record.top_ids.shape == (0, 4)
    assert record.output == result.token_ids
    with pytest.raises(ValueError):
        Recorder(mode="some")
    with pytest.raises(ValueError):
        Recorder(top_k=0)


# ---------------------------------------------------------------------------- 3. buffer
def _numbered(i: int, n: int) -> RequestRecord:
    """Record i with n positions; each row's ids say (i, position) to check the cut."""
    positions = list(range(100, 100 + n))
    ids = torch.tensor([[i, p] for p in positions], dtype=torch.int64).reshape(n, 2)
    return RequestRecord([0] * 200, 1, positions, ids, torch.full((n, 2), 0.5), str(i))


def test_replay_buffer_stays_bounded_first_in_first_out():
    import random

    rng = random.Random(7)
    cap = 40
    buf = ReplayBuffer(cap)
    added: list[tuple[int, int]] = []  # (record id, positions)
    for i in range(50):
        n = rng.choice([0, 1, 3, 7, 12, 20, 33, 45]) if i != 49 else 60
        buf.add(_numbered(i, n))
        assert buf.added_since_update == i + 1
        if n:
            added.append((i, n))
        assert buf.positions <= cap
        # expected: the longest run of newest records that fits; a newest record alone
        # bigger than the buffer keeps its newest `cap` positions
        keep, total = [], 0
        for rid, m in reversed(added):
            if total + m > cap:
                break
            keep.insert(0, rid)
            total += m
        kept = buf.records()
        if not keep:
            assert len(kept) == 1 and kept[0].domain == str(added[-1][0])
            last = kept[0]
            full = added[-1][1]
            assert last.positions == list(range(100 + full - cap, 100 + full))
            assert torch.equal(last.top_ids[:, 1], torch.tensor(last.positions))
            assert buf.positions == cap == len(last)
        else:
            assert [int(r.domain) for r in kept] == keep
            assert buf.positions == total == sum(len(r) for r in kept)
    assert not keep  # the last record (60 positions) was the cut one
    with pytest.raises(ValueError):
        ReplayBuffer(0)


# ---------------------------------------------------------------------------- 4. adapters
def _adapter(step: int, seed: int, domain: str = "code/py") -> Adapter:
    gen = torch.Generator().manual_seed(seed)
    state = {"model.layers.1.mlp.up_proj.weight": torch.randn(8, 4, generator=gen),
             "model.norm.weight": torch.randn(4, generator=gen)}
    return Adapter(domain, step, step // 2, state, {"draft": "tiny", "layers": 1})


def test_adapter_round_trip_keeps_tensors_and_step(tmp_path):
    saved = _adapter(6, seed=0)
    manifest = save_adapter(tmp_path, saved)
    assert manifest.parent.parent == tmp_path and "/" not in manifest.parent.name
    loaded = load_adapter(manifest.parent)
    assert (loaded.domain, loaded.step, loaded.updates) == ("code/py", 6, 3)
    assert same_tensors(loaded.state, saved.state)
    assert loaded.meta["draft"] == "tiny"
    # a newer save replaces it, old tensor files go
    save_adapter(tmp_path, _adapter(9, seed=1))
    assert load_all(tmp_path)["code/py"].step == 9
    files = [p.name for p in manifest.parent.glob("*.safetensors")]
    assert files == ["adapter-00000009.safetensors"]
    assert load_all(tmp_path / "nothing-here") == {}


def test_adapter_with_a_flipped_byte_is_refused(tmp_path):
    folder = save_adapter(tmp_path, _adapter(3, seed=0)).parent
    path = next(folder.glob("*.safetensors"))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # inside the tensor data: still a valid safetensors file
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match="sha256") as err:
        load_adapter(folder)
    assert f"delete {folder}" in str(err.value)
    (folder / "adapter.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(InputError, match="delete"):
        load_adapter(folder)


def test_crash_before_the_manifest_leaves_the_previous_adapter(tmp_path, monkeypatch):
    old = _adapter(4, seed=0)
    folder = save_adapter(tmp_path, old).parent

    def crash(*args, **kwargs):
        raise OSError("killed between the tensor file and the manifest")

    monkeypatch.setattr(adapters_mod, "write_json", crash)
    with pytest.raises(OSError, match="killed"):
        save_adapter(tmp_path, _adapter(8, seed=1))
    assert (folder / "adapter-00000008.safetensors").is_file()  # the crash came after it
    loaded = load_adapter(folder)
    assert loaded.step == 4 and same_tensors(loaded.state, old.state)
    assert json.loads((folder / "adapter.json").read_text())["step"] == 4
    monkeypatch.undo()
    save_adapter(tmp_path, _adapter(8, seed=1))
    assert load_adapter(folder).step == 8


def test_collect_keeps_the_last_good_draft_when_a_saved_file_is_torn(tmp_path, draft_m,
                                                                     records):
    cfg = OnlineConfig(interval=2, probe_every=3, layers=1, tolerance=1.0, root=str(tmp_path),
                       distill=DistillConfig(steps=3, lr=1e-2))
    serving = copy.deepcopy(draft_m)
    base = tensors(serving)
    svc = distiller(cfg, serving, wait=False)
    feed(svc, records[:3])  # the third is the probe: an update runs, saved, not yet taken
    assert len(svc.history) == 0
    svc.before_request("default")  # takes it and swaps it in
    assert [h.accepted for h in svc.history] == [True]
    good = tensors(serving)
    assert not same_tensors(good, base)
    assert svc.adapters["default"].step == 3
    feed(svc, records[3:5])  # a second update, saved to disk...
    folder = tmp_path / "default"
    path = next(folder.glob("*.safetensors"))
    assert path.name == "adapter-00000006.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # ...and torn before the distiller loads it
    path.write_bytes(bytes(data))
    svc.before_request("default")
    assert [h.accepted for h in svc.history] == [True, True]  # the worker accepted it
    assert svc.adapters["default"].step == 3  # the distiller did not take it
    assert same_tensors(tensors(serving), good)
    svc.close()


# ---------------------------------------------------------------------------- 5. guard
def _guard_cfg(**distill) -> OnlineConfig:
    return OnlineConfig(interval=2, probe_every=2, probe=4, layers=1, save=False,
                        distill=DistillConfig(**distill))


def test_guard_rejects_a_poisoned_update_and_keeps_serving(draft_m, records):
    gen = torch.Generator().manual_seed(0)
    serving = copy.deepcopy(draft_m)
    before = tensors(serving)
    svc = distiller(_guard_cfg(steps=30, lr=0.05, loss="fkl"), serving)
    # odd requests train (poisoned), even ones are the probe (real)
    feed(svc, [poisoned(records[0], gen, 64), records[1], poisoned(records[2], gen, 64),
               records[3]])
    assert len(svc.history) == 1
    result = svc.history[-1]
    assert result.accepted is False and "probe" in result.reason
    assert result.before > 0.3 and result.after < result.before
    svc.before_request("default")
    assert "default" not in svc.adapters
    assert same_tensors(tensors(serving), before)
    svc.close()


def test_guard_rejects_non_finite_records(draft_m, records):
    serving = copy.deepcopy(draft_m)
    before = tensors(serving)
    svc = distiller(_guard_cfg(steps=4, lr=1e-3), serving)
    bad = [RequestRecord(r.tokens, r.prompt_len, r.positions, r.top_ids,
                         torch.full_like(r.top_probs, float("nan")), r.domain)
           for r in records]
    feed(svc, [bad[0], records[1], bad[2], records[3]])
    result = svc.history[-1]
    assert result.accepted is False and "non-finite" in result.reason
    svc.before_request("default")
    assert same_tensors(tensors(serving), before)
    svc.close()


def test_guard_accepts_a_good_update_that_raises_probe_agreement(target_m, draft_m, records):
    serving = copy.deepcopy(draft_m)
    before = tensors(serving)
    svc = distiller(_guard_cfg(steps=30, lr=5e-3), serving)
    # the same prompts train and probe: the probe resembles the training traffic
    feed(svc, [records[0], records[0], records[1], records[1]])
    assert len(svc.history) == 1
    result = svc.history[-1]
    assert result.accepted is True and result.reason == ""
    assert result.after > result.before + 0.1
    assert (result.step, result.updates) == (30, 1)
    svc.before_request("default")
    assert svc.adapters["default"].step == 30
    assert not same_tensors(tensors(serving), before)
    # the swapped-in draft accepts more on those prompts when really decoding
    plain = record_requests(chain_engine(target_m, copy.deepcopy(draft_m)), PROMPTS[:2], "all")
    tuned = record_requests(chain_engine(target_m, serving), PROMPTS[:2], "all")
    assert [r.output for r in tuned] == [r.output for r in plain]
    assert sum(r.accepted for r in tuned) > sum(r.accepted for r in plain) + 4
    svc.close()


# ---------------------------------------------------------------------------- 6. restart
def test_restart_loads_the_saved_adapter_into_the_serving_draft(tmp_path, draft_m, records):
    cfg = OnlineConfig(interval=2, probe_every=2, probe=4, layers=1, root=str(tmp_path),
                       distill=DistillConfig(steps=30, lr=5e-3))
    first = distiller(cfg, copy.deepcopy(draft_m))
    feed(first, [records[0], records[0], records[1], records[1]])
    assert first.history and first.history[-1].accepted
    step = first.adapters["default"].step
    trained = first.adapters["default"].state
    assert step == 30 and len(first.history) == 1
    first.close()

    serving = copy.deepcopy(draft_m)
    base = tensors(serving)
    again = distiller(cfg, serving)
    assert again.adapters["default"].step == step
    assert same_tensors(again.adapters["default"].state, trained)
    assert same_tensors(tensors(serving), base)  # nothing served before a request
    again.before_request("default")
    now = tensors(serving)
    names = trainable_names(serving, 1)
    assert sorted(trained) == names
    for name in names:
        assert torch.equal(now[name], trained[name]), name
        assert name.startswith(("model.layers.1.", "model.norm."))
    assert any(not torch.equal(trained[n], base[n]) for n in names)
    assert all(torch.equal(now[n], base[n]) for n in base if n not in trained)
    # another domain serves the base draft again
    again.before_request("other")
    assert same_tensors(tensors(serving), base)
    again.close()


# ---------------------------------------------------------------------------- 7. exactness
def test_greedy_outputs_stay_exact_while_drafts_are_swapped(target_m, draft_m):
    serving = copy.deepcopy(draft_m)
    base = tensors(serving)
    engine = chain_engine(target_m, serving)
    plain = Engine(TorchBackend(target_m, "plain"), None, eos_token_ids=[])
    # a large learning rate and a lenient guard: every update is accepted and moves the draft
    cfg = OnlineConfig(interval=2, probe_every=3, probe=4, layers=1, tolerance=1.0,
                       save=False, distill=DistillConfig(steps=4, lr=2e-2))
    svc = distiller(cfg, serving)
    svc.check_engine(engine)
    steps_seen, stats_by_prompt = set(), {}
    prompts = [PROMPTS[i % 4] for i in range(16)]
    for prompt in prompts:
        domain = svc.domain(None, prompt)
        svc.before_request(domain)
        steps_seen.add(svc.applied[1] if svc.applied else 0)
        result = engine.generate(prompt, max_new_tokens=MAX_NEW, recorder=svc.recorder)
        svc.after_request(svc.recorder.take(result.token_ids, domain, result.stats.drafted,
                                            result.stats.accepted))
        expected = plain.generate(prompt, max_new_tokens=MAX_NEW).token_ids
        assert result.token_ids == expected, prompt
        stats_by_prompt.setdefault(tuple(prompt), set()).add(tuple(result.stats.steps))
    assert sum(h.accepted for h in svc.history) >= 3
    assert len(steps_seen) >= 3  # several different drafts served
    assert not same_tensors(tensors(serving), base)
    # the draft's behaviour changed: some prompt was drafted differently across swaps
    assert any(len(s) > 1 for s in stats_by_prompt.values())
    svc.close()


def test_a_static_runtime_draft_is_distilled_in_place(target_m, draft_m):
    """The GPU's default draft runtime (the static one, at the fixed shapes a GPU captures as
    CUDA graphs, run eagerly here) serves under online distillation: its parameters carry
    transformers' names, so the trainable layers are found and adapters are copied into the
    very tensors the passes read; outputs stay the target's."""
    from adaspec.backends.torch.static import static_backend

    draft = static_backend(copy.deepcopy(draft_m), "draft", graphs="eager")
    assert trainable_names(draft.model, 1) == trainable_names(draft_m, 1)
    base = tensors(draft.model)
    engine = Engine(TorchBackend(target_m, "target"), None, ModelDrafter(draft),
                    StaticLength(3), eos_token_ids=[])
    plain = Engine(TorchBackend(target_m, "plain"), None, eos_token_ids=[])
    cfg = OnlineConfig(interval=2, probe_every=3, probe=4, layers=1, tolerance=1.0,
                       save=False, distill=DistillConfig(steps=4, lr=2e-2))
    # the student trains a transformers copy of the draft (the worker loads one by name)
    svc = OnlineDistiller(cfg, draft.model, "tiny-draft", in_process=True, wait=True,
                          student=Student(copy.deepcopy(draft_m), cfg.layers))
    svc.check_engine(engine)
    for prompt in [PROMPTS[i % 4] for i in range(10)]:
        domain = svc.domain(None, prompt)
        svc.before_request(domain)
        result = engine.generate(prompt, max_new_tokens=MAX_NEW, recorder=svc.recorder)
        svc.after_request(svc.recorder.take(result.token_ids, domain, result.stats.drafted,
                                            result.stats.accepted))
        assert result.token_ids == plain.generate(prompt, max_new_tokens=MAX_NEW).token_ids
    assert sum(h.accepted for h in svc.history) >= 1
    assert not same_tensors(tensors(draft.model), base)
    svc.close()


def test_the_update_worker_trains_on_the_serving_drafts_device(draft_m):
    """OSD's updates run where the serving draft is (a GPU's spare compute when it serves
    there): the worker is told the draft's device; the student's state comes back on the
    CPU (it crosses to the serving process). The device is read from the model: here a
    draft on `meta` stands in for one on `cuda`."""
    cfg = OnlineConfig(layers=1, save=False)
    student = Student(copy.deepcopy(draft_m), 1)
    on_meta = copy.deepcopy(draft_m).to("meta")
    svc = OnlineDistiller(cfg, on_meta, "tiny-draft", in_process=True, student=student)
    assert svc.worker_settings(cfg).device == "meta"
    assert distiller(cfg, draft_m).worker_settings(cfg).device == "cpu"
    assert all(t.device.type == "cpu" for t in student.state().values())


# ---------------------------------------------------------------------------- 8. worker
def test_process_worker_runs_an_update_and_fails_fast_on_a_bad_draft(tmp_path, model_dirs):
    _, draft_dir = model_dirs
    vocab = len(bpe_tokenizer())
    # the saved pair's weights (save_tiny_pair uses these seeds), to record real traffic
    target = tiny_model(vocab=vocab, seed=0)
    draft = tiny_model(vocab=vocab, seed=1, layers=1)
    prompts = [[5, 6, 7], [100, 200, 250], [280, 10, 11, 12]]
    recs = record_requests(chain_engine(target, draft), prompts, "all")
    assert all(len(r) and max(r.tokens) < vocab for r in recs)
    settings = WorkerSettings(draft=draft_dir, layers=1, distill=DistillConfig(steps=2),
                              root=str(tmp_path))
    worker = ProcessWorker(settings)
    try:
        assert not worker.busy
        worker.submit(UpdateRequest("default", recs[:2], recs[2:]))
        assert worker.busy
        results = worker.results(wait=True)
    finally:
        worker.close()
    assert worker.errors == []
    assert len(results) == 1 and isinstance(results[0], UpdateResult)
    result = results[0]
    assert result.domain == "default" and result.accepted, result.reason
    assert (result.step, result.updates) == (2, 1)
    saved = load_adapter(Path(result.manifest).parent)
    assert saved.step == 2 and sorted(saved.state) == trainable_names(draft, 1)
    # the worker trained from the draft's weights (loaded as bf16) and moved them
    base = serving_state(draft.to(torch.bfloat16).float(), trainable_names(draft, 1))
    assert any(not torch.equal(saved.state[n], base[n]) for n in base)

    missing = WorkerSettings(draft=str(tmp_path / "no-such-draft"), layers=1,
                             distill=DistillConfig(steps=2), root=str(tmp_path))
    with pytest.raises(AdaspecError) as err:
        ProcessWorker(missing, timeout=120)
    assert "no-such-draft" in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------- 9. domains
def test_domain_classifier_learns_two_token_distributions():
    import random

    rng = random.Random(3)

    def code() -> list[int]:  # low token ids
        return [rng.randrange(0, 20) for _ in range(rng.randrange(5, 15))]

    def prose() -> list[int]:  # high token ids
        return [rng.randrange(40, 64) for _ in range(rng.randrange(5, 15))]

    chooser = DomainChooser("classifier")
    assert chooser.choose(None, code()) == "default"  # nothing learnt yet
    for _ in range(10):
        assert chooser.choose("code", code()) == "code"
        assert chooser.choose("prose", prose()) == "prose"
    assert all(chooser.choose(None, code()) == "code" for _ in range(20))
    assert all(chooser.choose(None, prose()) == "prose" for _ in range(20))
    assert chooser.choose("", prose()) == "prose"

    shared = DomainChooser("shared")
    assert {shared.choose(d, code()) for d in ("code", "prose", None)} == {"default"}
    field = DomainChooser("field")
    assert field.choose("code", code()) == "code" and field.choose(None, code()) == "default"
    with pytest.raises(InputError):
        DomainChooser("guess")
    with pytest.raises(InputError):
        OnlineConfig(record="some")


def test_each_domain_has_its_own_buffer_probe_and_draft(draft_m, records):
    cfg = OnlineConfig(interval=2, probe_every=3, probe=4, layers=1, tolerance=1.0,
                       domains="field", save=False, distill=DistillConfig(steps=3, lr=1e-2))
    serving = copy.deepcopy(draft_m)
    base = tensors(serving)
    svc = distiller(cfg, serving)
    requests = []
    submit = svc.worker.submit
    svc.worker.submit = lambda req: (requests.append(req), submit(req))[1]
    assert svc.domain("a", PROMPTS[0]) == "a"
    feed(svc, records[:3], "a")
    feed(svc, records[3:5], "b")  # two of b: no probe yet, no update
    assert [r.domain for r in requests] == ["a"]
    feed(svc, records[5:6], "b")
    assert [r.domain for r in requests] == ["a", "b"]
    for req in requests:
        assert {r.domain for r in req.records} == {req.domain}
        assert {r.domain for r in req.probe} == {req.domain}
    a, b = svc.buffers["a"], svc.buffers["b"]
    assert [r.tokens for r in a.records()] == [r.tokens for r in records[:2]]
    assert [r.tokens for r in b.records()] == [r.tokens for r in records[3:5]]
    assert a.positions == len(records[0]) + len(records[1])
    assert [r.tokens for r in svc.probes["b"]] == [records[5].tokens]
    assert set(svc.adapters) == {"a", "b"}
    svc.before_request("a")
    served_a = tensors(serving)
    svc.before_request("b")
    served_b = tensors(serving)
    assert not same_tensors(served_a, served_b)
    assert not same_tensors(served_a, base) and not same_tensors(served_b, base)
    svc.before_request("c")
    assert same_tensors(tensors(serving), base)
    svc.close()


# ---------------------------------------------------------------------------- 10. student
@pytest.mark.parametrize("layers", [1, 2])
def test_student_log_probs_equal_the_full_forward(layers):
    model = tiny_model(seed=2, layers=2, random_norms=True)
    student = Student(copy.deepcopy(model), layers)
    tokens = [5, 9, 1, 33, 2, 60, 7, 8, 14, 3]
    positions = [1, 4, 5, 9]
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)
    expected = full[[p - 1 for p in positions]]
    for _ in range(2):  # the second call reads the cached boundary
        torch.testing.assert_close(student.log_probs(tokens, positions), expected,
                                   atol=1e-5, rtol=0)
    assert torch.equal(student.predictions(tokens, 3), full[2:-1].argmax(-1))
    # gradients reach the trainable layers only
    student.log_probs(tokens, positions).sum().backward()
    grads = {n for n, p in student.model.named_parameters() if p.grad is not None}
    assert grads and grads <= set(student.names)
    assert student.names == trainable_names(model, layers)
    with pytest.raises(InputError):
        Student(copy.deepcopy(model), 3)


def test_apply_to_serving_requantizes_an_int8_draft_and_int8_dyn_is_refused():
    from adaspec.store.quant import Int8WeightLinear, quantize_model

    model = tiny_model(seed=2, layers=2)
    names = trainable_names(model, 1)
    name = "model.layers.1.mlp.up_proj.weight"
    quant = copy.deepcopy(model)
    quantize_model(quant, "int8")
    assert name not in dict(quant.named_parameters())  # its weight is quantized now
    assert trainable_names(quant, 1) == names
    start = serving_state(quant, names)
    torch.testing.assert_close(start[name], model.get_submodule(name[:-7]).weight)
    new = {n: t.clone() for n, t in start.items()}
    new[name] = start[name] + 0.5 * torch.randn_like(start[name])
    new["model.norm.weight"] = start["model.norm.weight"] * 2
    layer_before = quant.get_submodule(name[:-7])
    qweight_before = layer_before.qweight.clone()
    apply_to_serving(quant, new)
    layer = quant.get_submodule(name[:-7])
    assert isinstance(layer, Int8WeightLinear)
    expected = Int8WeightLinear.quantize(new[name])
    assert torch.equal(layer.qweight, expected["qweight"])
    assert not torch.equal(layer.qweight, qweight_before)
    torch.testing.assert_close(layer.scales.float(), expected["scales"])
    torch.testing.assert_close(layer.dense.float(), new[name])
    assert torch.equal(quant.model.norm.weight, new["model.norm.weight"])
    # a layer the adapter keeps as it was stays as it was
    other = "model.layers.1.mlp.down_proj"
    torch.testing.assert_close(quant.get_submodule(other).dense.float(), start[f"{other}.weight"])

    dyn = copy.deepcopy(model)
    quantize_model(dyn, "int8-dyn")
    with pytest.raises(InputError, match="int8-dyn"):
        serving_state(dyn, trainable_names(dyn, 1))


def test_an_update_starts_every_interval_requests_or_at_enough_positions(draft_m, records):
    """`interval` counts a domain's requests; `positions` starts an update as soon as that
    many new positions are buffered, whichever comes first."""
    cfg = OnlineConfig(interval=100, positions=0, layers=1, probe_every=2,
                       distill=DistillConfig(steps=1), save=False)
    svc = distiller(cfg, copy.deepcopy(draft_m))
    feed(svc, records[:4])
    assert not svc.history  # 2 buffered requests: far from 100
    by_positions = distiller(dataclasses.replace(cfg, positions=1), copy.deepcopy(draft_m))
    feed(by_positions, records[:4])
    assert len(by_positions.history) >= 1
    by_requests = distiller(dataclasses.replace(cfg, interval=1), copy.deepcopy(draft_m))
    feed(by_requests, records[:4])
    assert len(by_requests.history) >= 1
    with pytest.raises(InputError, match="positions"):
        OnlineConfig(positions=-1)
