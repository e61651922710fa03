"""Hugging Face assisted generation on the same loaded models: what a Python user would
pick instead of adaspec, measured in the same process."""

from __future__ import annotations

import time

import torch


@torch.inference_mode()
def hf_generate(
    target_model,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_token_ids: list[int],
    assistant_model=None,
    num_assistant_tokens: int | None = None,
    schedule: str | None = None,
) -> tuple[list[int], float]:
    """Greedy `generate`, optionally with `assistant_model`; returns (new ids, seconds)."""
    kwargs: dict = dict(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_ids,
        pad_token_id=eos_token_ids[0] if eos_token_ids else None,
    )
    if assistant_model is not None:
        kwargs["assistant_model"] = assistant_model
        if num_assistant_tokens is not None:
            assistant_model.generation_config.num_assistant_tokens = num_assistant_tokens
        if schedule is not None:
            assistant_model.generation_config.num_assistant_tokens_schedule = schedule
    ids = torch.tensor([prompt_ids])
    t0 = time.perf_counter()
    out = target_model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    elapsed = time.perf_counter() - t0
    new = [int(t) for t in out[0, len(prompt_ids) :]]
    while new and new[-1] in eos_token_ids and len(new) > 1 and new[-2] in eos_token_ids:
        new.pop()  # padding after EOS
    return new, elapsed
