"""Classify a greedy output that differs from plain decoding: numerical tie or bug.

bf16 logits of k tokens scored in one pass differ slightly from one-at-a-time scoring, so
a divergence where the reference's top-2 logits are nearly tied is numerics, not a bug.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaspec.backends.base import ModelBackend

TIE_TOLERANCE = 0.125  # logits; one bf16 ulp at magnitude 16-32 (a gap of one ulp is a tie)
# The llama.cpp runtimes (by the backend's kind): a token's top-2 gap moves by up to 0.31 (ik)
# / 0.27 (mainline) logits between its single-token pass and a block on the Q4_K_M target
# (docs/cost-profile.md); 0.5 bounds both.
GGUF_TIE_TOLERANCE = 0.5
GGUF_KINDS = ("ik_llama", "llamacpp")
# ik_llama.cpp feeding blocks only, or built so a lone token scores as in a block (its
# backend's batch_noise is then 0): plain decoding and verification score the same bits, so
# any divergence is a bug (experiments/results/batch-noise-native-epyc: 0.0 over every row).
EXACT_KINDS = ("ik_llama",)


def tie_tolerance(target: object) -> float:
    """The largest top-2 gap at which a greedy divergence on this target's runtime is a
    numerical tie (its kernels' noise between a lone token and a block)."""
    kind = str(getattr(target, "kind", ""))
    if kind.startswith(EXACT_KINDS) and getattr(target, "batch_noise", None) == 0:
        return 0.0
    return GGUF_TIE_TOLERANCE if kind.startswith(GGUF_KINDS) else TIE_TOLERANCE


@dataclass(frozen=True)
class Divergence:
    index: int  # first differing generated token
    gap: float  # reference top-1 minus top-2 logit there
    kind: str  # "tie" or "bug"
    tolerance: float = TIE_TOLERANCE  # the largest gap judged a tie (the runtime's noise)


def first_difference(reference: list[int], output: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(reference, output, strict=False)):
        if a != b:
            return i
    if len(reference) != len(output):
        return min(len(reference), len(output))
    return None


def classify(
    target: ModelBackend,
    prompt_ids: list[int],
    reference: list[int],
    output: list[int],
    tolerance: float | None = None,
) -> Divergence | None:
    """None when the outputs agree; otherwise where and why they part. The tie tolerance is
    the target runtime's own (`tie_tolerance`) unless given."""
    if tolerance is None:
        tolerance = tie_tolerance(target)
    index = first_difference(reference, output)
    if index is None:
        return None
    if index >= min(len(reference), len(output)):
        # One stopped early (EOS at a place the other did not choose): judge that token.
        index = min(index, len(reference) - 1)
    logits = target.prefill(torch.tensor(prompt_ids + reference[:index])).logits[-1].float()
    top2 = torch.topk(logits, 2).values
    gap = float(top2[0] - top2[1])
    kind = "tie" if gap <= tolerance else "bug"
    return Divergence(index=index, gap=gap, kind=kind, tolerance=tolerance)
