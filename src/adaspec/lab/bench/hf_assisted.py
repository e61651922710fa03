"""Hugging Face assisted generation on the same loaded models: what a Python user would
pick instead of adaspec, measured in the same process.

HF `generate` reports no per-step statistics, so forward hooks on the target and the
assistant count calls and time them; the number of draft tokens verified by each target call
and the tokens it kept are read from the call's input length and cache position, which gives
the same `RequestStats` fields the adaspec engine fills (calls, drafted, accepted, steps,
draft / verify / prefill time).
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager

import torch

from adaspec.core.metrics import RequestStats
from adaspec.core.sampling import SamplingParams


class _CallRecorder:
    """Forward hooks on a model: per call, the number of fed tokens, the cache length before
    the call, and the seconds it took."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.calls: list[tuple[int, int, float]] = []
        self._t0 = 0.0
        self._start = (0, 0)
        self._handles: list = []

    def _pre(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        n = int(ids.shape[-1]) if ids is not None else 0
        past = kwargs.get("past_key_values")
        cached = int(past.get_seq_length()) if past is not None else 0
        self._start = (n, cached)
        self._t0 = time.perf_counter()

    def _post(self, module, args, kwargs, output) -> None:
        self.calls.append((*self._start, time.perf_counter() - self._t0))

    def __enter__(self) -> _CallRecorder:
        self._handles = [
            self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.model.register_forward_hook(self._post, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()


@contextmanager
def _assistant_config(assistant_model, num_assistant_tokens: int | None, schedule: str | None):
    """Set the assistant's schedule for one call and restore its generation config after, so
    one reference method never leaks its settings into the next."""
    saved = copy.deepcopy(assistant_model.generation_config)
    try:
        cfg = assistant_model.generation_config
        if num_assistant_tokens is not None:
            cfg.num_assistant_tokens = num_assistant_tokens
        if schedule is not None:
            cfg.num_assistant_tokens_schedule = schedule
            if schedule == "constant":
                cfg.assistant_confidence_threshold = 0.0  # no early stop: truly k per step
        yield
    finally:
        assistant_model.generation_config = saved


def reference_settings(name: str, params: dict) -> dict:
    """hf_generate keyword arguments for a reference method spec."""
    if name == "hf-assisted":
        return {}  # HF's defaults for an assistant model
    if name == "hf-assisted-constant":
        return {"num_assistant_tokens": int(params["k"]), "schedule": "constant"}
    raise ValueError(f"not a reference method: {name}")


def steps_from_calls(
    calls: list[tuple[int, int, float]], prompt_len: int, new_tokens: int
) -> list[tuple[int, int]]:
    """(drafted, accepted) per target call of an assisted generation.

    Call j feeds [last kept token, draft...] after `cached` tokens (the first call feeds the
    whole prompt + draft). The tokens call j kept are the growth of the cache from call j to
    call j + 1; the last call's are what remains of `new_tokens`."""
    steps: list[tuple[int, int]] = []
    prev = prompt_len - 1  # as if the prompt's last token were fed by the first call
    emitted_total = 0
    for j, (fed, _cached, _) in enumerate(calls):
        drafted = fed - (prompt_len if j == 0 else 1)
        if j + 1 < len(calls):
            emitted = calls[j + 1][1] - prev
            prev = calls[j + 1][1]
        else:
            emitted = new_tokens - emitted_total
        emitted_total += emitted
        steps.append((max(0, drafted), max(0, min(emitted - 1, drafted))))
    return steps


@torch.inference_mode()
def hf_generate(
    target_model,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_token_ids: list[int],
    assistant_model=None,
    num_assistant_tokens: int | None = None,
    schedule: str | None = None,
    sampling: SamplingParams | None = None,
) -> tuple[list[int], RequestStats]:
    """`generate`, optionally with `assistant_model`; returns (new ids, stats)."""
    sampling = sampling or SamplingParams()
    kwargs: dict = dict(
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_ids,
        pad_token_id=eos_token_ids[0] if eos_token_ids else None,
    )
    if sampling.greedy:
        kwargs.update(do_sample=False)
    else:
        kwargs.update(
            do_sample=True,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
        )
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
    if assistant_model is not None:
        kwargs["assistant_model"] = assistant_model
    ids = torch.tensor([prompt_ids])
    with (
        _assistant_config(assistant_model, num_assistant_tokens, schedule)
        if assistant_model is not None
        else _nothing(),
        _CallRecorder(target_model) as tgt,
        _CallRecorder(assistant_model) if assistant_model is not None else _nothing() as drf,
    ):
        t0 = time.perf_counter()
        out = target_model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        elapsed = time.perf_counter() - t0
    new = [int(t) for t in out[0, len(prompt_ids) :]]
    if eos_token_ids:
        for i, t in enumerate(new):  # drop padding after the first EOS
            if t in eos_token_ids:
                new = new[: i + 1]
                break
    stats = RequestStats(prompt_tokens=len(prompt_ids), new_tokens=len(new), wall_time=elapsed)
    stats.target_calls = len(tgt.calls)
    if tgt.calls:
        stats.prefill_time = tgt.calls[0][2]
        stats.verify_time = sum(c[2] for c in tgt.calls[1:])
    if drf is not None:
        stats.draft_calls = len(drf.calls)
        stats.draft_time = sum(c[2] for c in drf.calls)
        stats.steps = [s for s in steps_from_calls(tgt.calls, len(prompt_ids), len(new)) if s[0]]
        stats.drafted = sum(d for d, _ in stats.steps)
        stats.accepted = sum(a for _, a in stats.steps)
    return new, stats


@contextmanager
def _nothing():
    yield None
