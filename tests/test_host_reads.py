"""The loop off the host's critical path (issue 34): a greedy step leaves the target's logits
where the model ran and reads back only the argmax ids, once per step. A GPU is simulated on
the CPU by a tensor type that says it lives on `cuda` and counts every read to the host."""

from __future__ import annotations

import torch

from adaspec.backends.base import ForwardOutput
from adaspec.backends.static_torch import StaticTorchBackend, static_backend
from adaspec.engine.loop import Engine
from adaspec.methods.build import build_engine

from .conftest import tiny_model

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


class SimulatedGpu(StaticTorchBackend):
    """The static runtime whose logits come back as `DeviceRows`."""

    def _run(self, *args, **kwargs) -> ForwardOutput:
        out = super()._run(*args, **kwargs)
        return ForwardOutput(out.device_logits.as_subclass(DeviceRows), out.hidden)


def simulated(model) -> SimulatedGpu:
    plain = static_backend(model, "tiny", graphs="eager")
    backend = SimulatedGpu(plain.model, "tiny", plain.max_context, graphs="eager")
    return backend


def test_a_greedy_step_reads_back_its_argmax_ids_once():
    model = tiny_model(seed=21)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # repeats: the n-gram drafter drafts
    want = build_engine("ar", static_backend(model, "ref"), None, None,
                        eos_token_ids=[]).generate(prompt, 40).token_ids
    DeviceRows.reads = []
    result = build_engine("ngram:k=4", simulated(model), None, None,
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

    def on_host(proposal, out, sampling, generator, verifier, rows=slice(None)):
        return verifier.verify(proposal, out.logits[rows], generator)

    DeviceRows.reads = []
    monkeypatch.setattr(Engine, "_verify", staticmethod(on_host))
    build_engine("ngram:k=4", simulated(model), None, None, eos_token_ids=[]).generate(prompt, 40)
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


def test_a_greedy_draft_chain_reads_back_one_id_per_drafted_token():
    """The draft model on the (simulated) GPU: a greedy chain under a length rule that reads
    no distribution brings back each drafted token's id only; a rule that reads the draft's
    distribution (ctrl=confidence) gets its rows on the host."""
    target, draft = tiny_model(seed=21), tiny_model(seed=22, layers=1)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    want = build_engine("ar", static_backend(target, "ref"), None, None,
                        eos_token_ids=[]).generate(prompt, 30).token_ids
    DeviceRows.reads = []
    result = build_engine("draft:k=3", simulated(target), None, simulated(draft),
                          eos_token_ids=[]).generate(prompt, 30)
    assert result.token_ids == want and result.stats.draft_calls > 0
    assert DeviceRows.reads and all(n <= 5 for _, n in DeviceRows.reads)
    DeviceRows.reads = []
    result = build_engine("draft:ctrl=confidence,k=3", simulated(target), None,
                          simulated(draft), eos_token_ids=[]).generate(prompt, 30)
    assert result.token_ids == want
    assert any(what == "cpu" and n >= 64 for what, n in DeviceRows.reads)
