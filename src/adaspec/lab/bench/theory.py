"""Theory beside practice: what speculative decoding *should* give, from measured inputs.

- Leviathan et al. (2023), "Fast Inference from Transformers via Speculative Decoding":
  with per-token acceptance probability alpha (i.i.d.), gamma draft tokens per step and cost
  ratio c = draft forward time / target forward time, the expected wall-time improvement
  over plain decoding is (1 - alpha^(gamma+1)) / ((1 - alpha) (gamma c + 1)).
- The oracle speculation length: the draft keeps drafting exactly until its first mismatch
  with the target (so every drafted token is accepted and no draft call is wasted). Under
  greedy decoding that is read off one teacher-forced draft pass over prompt + the target's
  own output: position i is a hit when the draft's argmax given the true prefix equals the
  target's token.
"""

from __future__ import annotations

import torch

from adaspec.backends.base import ModelBackend


def per_token_alpha(steps: list[tuple[int, int]]) -> float | None:
    """Maximum-likelihood per-token acceptance probability of the geometric model: accepted
    tokens over tokens actually put to the test (each step tests up to and including its
    first rejection). `accepted / drafted` is lower, because drafted tokens after a rejection
    count in its denominator without ever being judged."""
    accepted = sum(a for _, a in steps)
    rejections = sum(1 for d, a in steps if a < d)
    tested = accepted + rejections
    return accepted / tested if tested else None


def expected_tokens_per_step(alpha: float, gamma: float) -> float:
    """E[tokens per target call] = (1 - alpha^(gamma+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1.0)) / (1.0 - alpha)


def leviathan_speedup(alpha: float, gamma: float, c: float) -> float:
    """Leviathan et al.'s expected improvement factor in wall time."""
    return expected_tokens_per_step(alpha, gamma) / (gamma * c + 1.0)


@torch.inference_mode()
def teacher_forced_logits(
    draft: ModelBackend, prompt_ids: list[int], output: list[int], chunk: int = 256
) -> torch.Tensor:
    """[len(output), V] the draft's raw logits for output[i] given prompt + output[:i], from
    one teacher-forced pass (in chunks of `chunk` tokens); resets the draft's cache."""
    seq = prompt_ids + output[:-1]
    first = len(prompt_ids) - 1  # the row that predicts output[0]
    rows: list[torch.Tensor] = []
    draft.reset()
    for start in range(0, len(seq), chunk):
        piece = seq[start : start + chunk]
        logits = draft.forward(torch.tensor(piece)).logits
        lo = max(first - start, 0)
        if lo < len(piece):
            rows.append(logits[lo:])
    draft.reset()
    return torch.cat(rows) if rows else torch.empty(0, draft.vocab_size)


def teacher_forced_hits(
    draft: ModelBackend, prompt_ids: list[int], output: list[int], chunk: int = 256
) -> list[bool]:
    """hits[i]: the draft's greedy token after prompt + output[:i] equals output[i]."""
    if not output:
        return []
    preds = teacher_forced_logits(draft, prompt_ids, output, chunk).argmax(dim=-1)
    return [int(p) == t for p, t in zip(preds, output, strict=True)]


def oracle_schedule(hits: list[bool]) -> dict:
    """Target calls and draft calls of greedy decoding with an oracle speculation length.

    The first token comes from the prefill (one target call). Each later step drafts the run
    of hits starting at the next position (at most the tokens still to go, minus the one the
    target adds), costs one draft call per drafted token and one target call, and emits the
    run plus the target's own token."""
    n = len(hits)
    if n == 0:
        return {"new_tokens": 0, "target_calls": 0, "draft_calls": 0, "steps": []}
    p, target_calls, draft_calls = 1, 1, 0
    steps: list[int] = []
    while p < n:
        run = 0
        while run < n - p - 1 and hits[p + run]:
            run += 1
        steps.append(run)
        draft_calls += run
        target_calls += 1
        p += run + 1
    return {
        "new_tokens": n,
        "target_calls": target_calls,
        "draft_calls": draft_calls,
        "steps": steps,
    }
