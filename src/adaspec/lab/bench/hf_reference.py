"""Hugging Face `generate` on the same weights: what a Python user would pick instead of
adaspec (plain decoding, assisted generation with the draft, prompt lookup), measured in the
same process and on the same device. Its KV cache is static (preallocated) unless the method
says `cache=dynamic`; where HF's static cache fails for a mode (prompt lookup overruns it in
transformers 5.24), the bench falls back to the dynamic cache and says so.

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
from adaspec.lab.bench.references import HF_CACHES


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
        # the first fed token's position is the cache length before the call (a static
        # cache's own length counts slots ever written, not what a rollback kept)
        positions = kwargs.get("position_ids")
        if positions is not None:
            cached = int(positions.reshape(-1)[0])
        else:
            past = kwargs.get("cache", kwargs.get("past_key_values"))
            cached = int(past.get_seq_length()) if past is not None else 0
        self._start = (n, cached)
        self._sync()
        self._t0 = time.perf_counter()

    def _post(self, module, args, kwargs, output) -> None:
        self._sync()  # a GPU's call is timed when it is done, not when it is queued
        self.calls.append((*self._start, time.perf_counter() - self._t0))

    def _sync(self) -> None:
        if next(self.model.parameters()).device.type == "cuda":
            torch.cuda.synchronize()

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


HF_METHODS = ("hf", "hf-assisted", "hf-assisted-constant", "hf-lookup")


def reference_settings(name: str, params: dict) -> dict:
    """hf_generate keyword arguments for a reference method spec."""
    if name not in HF_METHODS:
        raise ValueError(f"not a reference method: {name}")
    settings: dict = {"cache": params.get("cache", "static")}
    if name == "hf-assisted-constant":
        settings.update(num_assistant_tokens=int(params["k"]), schedule="constant")
    if name == "hf-lookup":
        settings.update(lookup=int(params["k"]), lookup_ngram=int(params["n_max"]))
    return settings  # hf, hf-assisted: HF's defaults (an assistant's own schedule)


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
    cache: str = "static",
    lookup: int | None = None,
    lookup_ngram: int = 2,
) -> tuple[list[int], RequestStats]:
    """`generate`, optionally with `assistant_model` or prompt lookup (`lookup` tokens per
    step, n-grams up to `lookup_ngram`), on the target's device; returns (new ids, stats)."""
    sampling = sampling or SamplingParams()
    if cache not in HF_CACHES:
        raise ValueError(f"cache must be one of {', '.join(HF_CACHES)}, got {cache!r}")
    kwargs: dict = dict(
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_ids,
        pad_token_id=eos_token_ids[0] if eos_token_ids else None,
    )
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    if lookup is not None:
        kwargs.update(prompt_lookup_num_tokens=lookup, max_matching_ngram_size=lookup_ngram)
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
    ids = torch.tensor([prompt_ids], device=next(target_model.parameters()).device)
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
    new = [int(t) for t in out[0, len(prompt_ids) :].tolist()]
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
    if drf is not None or lookup is not None:  # the target's calls say what each verified
        stats.steps = [s for s in steps_from_calls(tgt.calls, len(prompt_ids), len(new)) if s[0]]
        stats.drafted = sum(d for d, _ in stats.steps)
        stats.accepted = sum(a for _, a in stats.steps)
    return new, stats


@contextmanager
def _nothing():
    yield None
