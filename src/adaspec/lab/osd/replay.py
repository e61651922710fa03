"""Teacher-forced replay: a greedy chain's steps, computed from the draft's guesses along the
target's output instead of by decoding.

Why it is the same: at temperature 0 the output is the target's whatever the draft does, and
a chain step's j-th draft token is compared only after the first j-1 were accepted, so each
draft token the verifier sees is the draft's guess given the target's own prefix. One
batched forward of the draft over prompt + output gives every guess; the steps follow. A test
checks that the counts and recorded positions equal the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaspec.online.record import RequestRecord


@dataclass
class ChainReplay:
    drafted: int
    accepted: int
    steps: list[tuple[int, int]]  # (drafted, accepted) per step
    rows: list[int]  # output indices whose target distribution a recorder keeps


def chain_steps(guesses: list[int], output: list[int], k: int, max_new_tokens: int,
                record: str = "rejected") -> ChainReplay:
    """The steps of a greedy chain of k drafting `output` (the first token is the prefill's;
    `guesses[i]` is the draft's guess of output[i] given the prompt and output[:i])."""
    n = len(output)
    i = 1
    drafted = accepted = 0
    steps: list[tuple[int, int]] = []
    rows: list[int] = []
    while i < n:
        d = min(k, max_new_tokens - i - 1)
        if d <= 0:
            i += 1
            continue
        a = 0
        while a < d and i + a < n and guesses[i + a] == output[i + a]:
            a += 1
        drafted += d
        accepted += a
        steps.append((d, a))
        if record == "all":
            rows.extend(range(i, min(i + a + 1, n)))
        elif a < d and i + a < n:
            rows.append(i + a)
        i += a + 1
    return ChainReplay(drafted, accepted, steps, rows)


def replay_record(prompt_ids: list[int], output: list[int], replay: ChainReplay,
                  top_ids: torch.Tensor, top_probs: torch.Tensor, domain: str
                  ) -> RequestRecord:
    """What the engine's recorder keeps of this request: `top_ids`/`top_probs` hold the
    target's distribution at every output index."""
    p = len(prompt_ids)
    rows = replay.rows
    return RequestRecord(prompt_ids + output, p, [p + i for i in rows], top_ids[rows].long(),
                         top_probs[rows].float(), domain, replay.drafted, replay.accepted)


@torch.no_grad()
def target_topk(backend, prompt_ids: list[int], output: list[int], top_k: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k at every output index (teacher-forced: one prefill of the prompt,
    one forward of the output but its last token)."""
    from adaspec.online.record import compact

    rows = [backend.prefill(torch.tensor(prompt_ids)).logits[-1:]]
    if len(output) > 1:
        rows.append(backend.forward(torch.tensor(output[:-1])).logits)
    ids, probs = compact(torch.cat(rows).float(), top_k)
    return ids.to(torch.int32), probs.to(torch.float16)
