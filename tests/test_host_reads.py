"""The loop off the host's critical path (issue 34): every step leaves the target's and the
draft's logits where the models ran and reads back only ids and a few numbers. A GPU is simulated on
the CPU by a tensor type that says it lives on `cuda` and counts every read to the host."""

from __future__ import annotations

import pytest
import torch

from adaspec.backends.base import ForwardOutput
from adaspec.backends.torch.static import StaticTorchBackend, static_backend
from adaspec.core.sampling import SamplingParams
from adaspec.engine.loop import Engine
from adaspec.methods.build import build_generator
from adaspec.online.record import Recorder

from .conftest import tiny_model
from .disco_helpers import artifact, classifier_on
from .test_auto import flat_profile

HOST_READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


class DeviceRows(torch.Tensor):
    """A tensor that says it is in a GPU's memory; `reads` logs (what, elements) per read
    back to the host."""

    reads: list[tuple[str, int]] = []

    @property
    def device(self) -> torch.device:  # type: ignore[override]  # why: the simulated GPU
        return torch.device("cuda")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            cls.reads.append((name, int(args[0].numel())))
        return super().__torch_function__(func, types, args, kwargs or {})


def _cuda(where) -> bool:
    return (isinstance(where, torch.device) and where.type == "cuda") or (
        isinstance(where, str) and where.startswith("cuda"))


FACTORIES = ("arange", "zeros", "ones", "full", "empty", "tensor", "rand", "randn")


@pytest.fixture(autouse=True)
def cuda_is_host_memory(monkeypatch):
    """The simulated GPU's memory is the CPU's: a tensor made or moved there (a request's
    uniform draws, a draft's rows for the target's verifier) stays on the CPU."""
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if _cuda(kwargs.get("device")):
            del kwargs["device"]
        return real_to(self, *(a for a in args if not _cuda(a)), **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    for name in FACTORIES:
        real = getattr(torch, name)

        def made(*args, _real=real, **kwargs):
            if _cuda(kwargs.get("device")):
                del kwargs["device"]
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, made)


class SimulatedGpu(StaticTorchBackend):
    """The static runtime whose logits come back as `DeviceRows`."""

    def _run(self, *args, **kwargs) -> ForwardOutput:
        out = super()._run(*args, **kwargs)
        return ForwardOutput(out.device_logits.as_subclass(DeviceRows), out.hidden)


def simulated(model, name: str = "tiny") -> SimulatedGpu:
    plain = static_backend(model, name, graphs="eager")
    return SimulatedGpu(plain.model, name, plain.max_context, graphs="eager")


def test_a_greedy_step_reads_back_its_argmax_ids_once():
    model = tiny_model(seed=21)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # repeats: the n-gram drafter drafts
    want = build_generator("ar", static_backend(model, "ref"), None, None,
                        eos_token_ids=[]).generate(prompt, 40).token_ids
    DeviceRows.reads = []
    result = build_generator("ngram:k=4", simulated(model), None, None,
                          eos_token_ids=[]).generate(prompt, 40)
    assert result.token_ids == want
    stats = result.stats
    assert stats.drafted > 0  # steps verified drafts, not only single tokens
    # one read per target pass (the prefill's first token included), each of the ids only
    assert len(DeviceRows.reads) == stats.target_calls
    assert all(what == "tolist" and n <= 5 for what, n in DeviceRows.reads)
    assert 0 < stats.target_time <= stats.verify_time
    assert stats.loop_time >= 0 and "loop_time" in stats.to_dict()


def test_negative_control_a_verifier_on_host_rows_reads_every_logit(monkeypatch):
    """The same run verified on the host copy of the rows (as before the change): each step
    then brings back [n, vocab] logits, which the assertion above would refuse."""
    model = tiny_model(seed=21)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]

    def on_host(proposal, out, sampling, generator, verifier, rows=slice(None), masks=None):
        return verifier.verify(proposal, out.logits[rows], generator)

    DeviceRows.reads = []
    monkeypatch.setattr(Engine, "_verify", staticmethod(on_host))
    build_generator("ngram:k=4", simulated(model), None, None,
                    eos_token_ids=[]).generate(prompt, 40)
    assert any(what == "cpu" and n >= 64 for what, n in DeviceRows.reads)


def test_the_host_copy_is_made_once_and_only_when_read():
    rows = torch.randn(3, 64).as_subclass(DeviceRows)
    DeviceRows.reads = []
    out = ForwardOutput(rows)
    assert DeviceRows.reads == []
    first = out.logits
    assert out.logits is first and DeviceRows.reads == [("cpu", 3 * 64)]
    plain = torch.randn(2, 8)
    assert ForwardOutput(plain).logits is plain  # CPU rows are their own host copy


DEVICE_FLOW = ("adaspec.verify.speculative", "adaspec.verify.multi_candidate",
               "adaspec.draft.model_tree", "adaspec.control.disco_features")


def on_cpu_as_on_a_gpu(monkeypatch) -> None:
    """The CPU run taking the branches a GPU run takes (`may_hold` answers True there
    without reading): the same random draws, so the same tokens as the simulated GPU."""
    for module in DEVICE_FLOW:
        monkeypatch.setattr(f"{module}.may_hold", lambda flags: True)


SAMPLED = SamplingParams(temperature=0.9, seed=11)
GREEDY = SamplingParams()


@pytest.mark.parametrize(("method", "sampling"), [
    ("ngram:k=4", SAMPLED),
    ("draft:k=3", GREEDY),
    ("draft:k=3", SAMPLED),
    ("draft:ctrl=confidence,k=3", GREEDY),
    ("draft:ctrl=confidence,k=3", SAMPLED),
    ("draft:ctrl=disco,k=3", SAMPLED),
    ("draft:tree=2x2", GREEDY),
    ("draft:tree=2x2", SAMPLED),
    ("draft:tree=2x2,verify=mcss", SAMPLED),
    ("auto:use=ngram+draft", GREEDY),
    ("auto:use=draft", SAMPLED),
    ("auto:use=draft,disco", GREEDY),
], ids=lambda v: v if isinstance(v, str) else ("sampled" if v.temperature else "greedy"))
def test_every_step_reads_back_ids_and_numbers_not_rows(monkeypatch, tmp_path, method,
                                                        sampling):
    """Target and draft on the (simulated) GPU, every kind of step: a read brings back a
    verdict's ids, a drafted token's id, a tree level's candidates or the few numbers a
    length rule decides by (DISCO's 11 features), never a row of the vocabulary; the tokens
    are the ones the CPU gives on the same branches with the same seed."""
    target, draft = tiny_model(seed=21), tiny_model(seed=22, layers=1)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    extra = {}
    if "disco" in method:
        path = tmp_path / "disco.pt"
        artifact(classifier_on(0, 4.0, -1.0)).save(path)
        method = method.replace("disco", f"disco={path}") if method.startswith("auto") \
            else f"{method},disco={path}"
    if method.startswith("auto"):
        extra["profile"] = flat_profile()

    def run(t, d):
        engine = build_generator(method, t, None, d, eos_token_ids=[], **extra)
        return engine.generate(prompt, 30, sampling=sampling)

    DeviceRows.reads = []
    draft_on_gpu = simulated(draft, "tiny-draft")
    result = run(simulated(target, "tiny-target"), draft_on_gpu)
    reads = list(DeviceRows.reads)
    # the draft cache's token ids, some fed from the device unread, are the sequence's
    cached = draft_on_gpu._ids.read()
    assert cached == (prompt + result.token_ids)[: draft_on_gpu.cache_len]
    on_cpu_as_on_a_gpu(monkeypatch)
    want = run(static_backend(target, "tiny-target", graphs="eager"),
               static_backend(draft, "tiny-draft", graphs="eager"))
    assert result.token_ids == want.token_ids
    assert result.stats.drafted > 0  # the draft was verified, not only single tokens
    assert reads and all(n <= 16 for _, n in reads), reads  # the vocabulary is 64 wide
    stats = result.stats
    if method.startswith(("ngram", "draft:k")) and not sampling.greedy:
        # a chain's verdict: accepted count and next token, one read per target pass
        verdicts = [r for r in reads if r == ("tolist", 2)]
        assert len(verdicts) >= stats.target_calls
    if method.startswith("draft:k") or (method == "draft:tree=2x2" and sampling.greedy):
        # a chain no length rule stops, and a greedy tree, are drawn on the device and
        # read once, whole: one read per proposal beside the verdict's one per target pass,
        # not one per drafted token or level
        assert stats.draft_calls > len(stats.steps)
        assert len(reads) == stats.target_calls + len(stats.steps)
    if method.startswith(("auto:use=draft", "draft:ctrl=")):
        # each drafted token: its id and the numbers its rule decides by (confidence; DISCO's
        # features) in one read
        assert stats.draft_calls > 0
        assert len(reads) == stats.target_calls + stats.draft_calls


def test_a_length_rule_on_host_rows_is_caught(monkeypatch):
    """Negative control for the test above: a confidence rule that copies the draft's row
    to the host (as before the change) reads [vocab] numbers per drafted token."""
    import adaspec.control.confidence as confidence

    def on_host(logits):
        return confidence_features(logits.cpu())

    confidence_features = confidence.distribution_features
    monkeypatch.setattr(confidence, "distribution_features", on_host)
    target, draft = tiny_model(seed=21), tiny_model(seed=22, layers=1)
    DeviceRows.reads = []
    build_generator("draft:ctrl=confidence,k=3", simulated(target), None, simulated(draft),
                 eos_token_ids=[]).generate([5, 6, 7, 8, 5, 6, 7], 10)
    assert any(what == "cpu" and n >= 64 for what, n in DeviceRows.reads)


def test_logprobs_and_the_distillation_record_read_their_numbers_not_rows():
    """`logprobs` (the emitted tokens' and 5 alternatives each) and online distillation's
    record (the target's top 8 per verified row) are computed where the rows are: what comes
    back is those numbers, far fewer than a 512-wide row; the tokens, logprobs and record
    equal the CPU's."""
    target, draft = tiny_model(vocab=512, seed=23), tiny_model(vocab=512, seed=24, layers=1)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    sampling = SamplingParams(temperature=0.8, seed=3, logprobs=5)

    def run(t, d):
        engine = build_generator("draft:k=3", t, None, d, eos_token_ids=[])
        recorder = Recorder(top_k=8, mode="all")
        result = engine.generate(prompt, 20, sampling=sampling, recorder=recorder)
        return result, recorder.take(result.token_ids)

    DeviceRows.reads = []
    (result, record) = run(simulated(target), simulated(draft))
    reads = list(DeviceRows.reads)
    want, want_record = run(static_backend(target, "tiny", graphs="eager"),
                                 static_backend(draft, "tiny", graphs="eager"))
    assert result.token_ids == want.token_ids and result.stats.drafted > 0
    assert result.logprobs == want.logprobs and len(result.logprobs) == 20
    assert all(len(lp.top) == 5 for lp in result.logprobs)
    assert torch.equal(record.top_ids, want_record.top_ids) and len(record.positions) > 0
    assert reads and all(n <= 5 * 8 for _, n in reads), reads
