"""DISCO data for a draft head (issue 66, part 1), from the features `adaspec head data`
recorded: no model call at all.

A head drafts token t at draft position d from its own output at position d - 1, not from
the target's feature, so unlike a model draft its distribution depends on d: one unrolled
pass (`draft/head_loss.unrolled`, the training loss's) gives its output for every token at
every position, and each example becomes a per-position `Sample` (`dist` [n, D, F], `hits`
[n, D]; index 0 is the answer's first token, which the prefill gives).

`hits[i, d]`: the head's top token at position d is the target's greedy token, and the chain
that reached it is one a real draft could run. The unrolled pass feeds the example's own
tokens back; a real chain feeds its drafted ones, so a chain through a token the text has but
the target would not have written (a ShareGPT answer is a person's) is marked a miss there.
For the target's own greedy answers (WMT, HumanEval, Spec-Bench) the two coincide.

Only examples the head never trained on are used (`lab/head/data.split_held` with the head's
share), split again by id into the classifier's training and validation sets. The head runs
in fp32 here (int8 at serving), and the prompt's features are hidden from it as the default
runtime hides them (only the prompt's last position is scored).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable

import torch

from adaspec.control.disco_features import TOP_K, distribution_features
from adaspec.draft.head_loss import Frozen, unrolled
from adaspec.draft.head_model import DraftHead
from adaspec.lab.disco.dataset import DiscoData, Sample


class _Loss:
    """What `unrolled` reads of the loss settings."""

    def __init__(self, features: str) -> None:
        self.features = features
        self.feature_weight = 0.0


def val_split(example_id: str, fraction: float) -> str:
    """"val" or "train" by the id's hash (a different salt from the head's held-out split)."""
    return "val" if zlib.crc32(f"disco/{example_id}".encode()) / 2**32 < fraction else "train"


@torch.no_grad()
def head_sample(head: DraftHead, frozen: Frozen, row: dict, depth: int, features: str,
                split: str) -> Sample | None:
    """One recorded example as a per-position sample of its answer (None: under 2 tokens)."""
    tokens = row["tokens"].long()
    total, prompt = len(tokens), int(row["prompt_len"])
    n = total - prompt
    if n < 2 or prompt < 1:
        return None
    outs = unrolled(head, frozen, row, _Loss(features), depth, visible_from=prompt - 1)
    t = torch.arange(prompt, total)  # the answer's tokens; index i = t - prompt
    label = row["top_ids"].long()[t - 1, 0]  # the target's greedy token at t
    known = row["top_probs"][t - 1, 0] > 0
    own = label == tokens[t]  # the text has the target's own token at t
    dist = torch.zeros(n, depth, TOP_K + 1)
    hits = torch.zeros(n, depth, dtype=torch.bool)
    for d, out in enumerate(outs):
        # a chain starts after the prefill's token (index 0): position d from index d + 1
        ok = torch.arange(n) >= d + 1
        idx = t - 2  # input index t - 2 (feature at t - 2, token t - 1) predicts token t
        small = frozen.token_head(out[idx])  # [n, kept]
        dist[:, d] = torch.where(ok[:, None], distribution_features(small), 0.0)
        drafted = frozen.token_head.token_ids[small.argmax(1)]
        chain = torch.ones(n, dtype=torch.bool)  # the tokens fed before t were the target's
        for back in range(1, d + 1):
            chain[back:] &= own[:-back]
        hits[:, d] = (drafted == label) & known & ok & chain
    return Sample(prompt_id=str(row["id"]), suite=str(row["id"]).rsplit("/", 1)[0],
                  category=str(row["id"]).split("/", 1)[0], split=split,
                  prompt_ids=tokens[:prompt].tolist(), output=tokens[prompt:].tolist(),
                  dist=dist, hits=hits)


def collect_head(head: DraftHead, frozen: Frozen, rows: Iterable[dict], depth: int,
                 features: str = "final", val_fraction: float = 0.3,
                 provenance: dict | None = None, progress: bool = True) -> DiscoData:
    """Per-position samples of every row (the caller passes the head's held-out ones)."""
    from tqdm import tqdm

    head = head.float().eval()
    t0 = time.perf_counter()
    samples = []
    for row in tqdm(list(rows), desc="head disco data", disable=not progress):
        s = head_sample(head, frozen, row, depth, features,
                        val_split(str(row["id"]), val_fraction))
        if s is not None:
            samples.append(s)
    prov = dict(provenance or {})
    prov.update(prompts=len(samples), tokens=sum(len(s.output) for s in samples),
                depth=depth, collect_seconds=round(time.perf_counter() - t0, 1),
                splits={n: sorted(s.prompt_id for s in samples if s.split == n)
                        for n in ("train", "val")})
    return DiscoData(samples=samples, provenance=prov)


def cold_step_ms(drafter, target, context: list[int], reps: int = 12) -> float:
    """The median ms of one head draft step right after a target call, as the engine runs
    it (the target's call evicts the head's weights from the caches; a cache-warm step,
    `HeadDrafter.step_ms`, is about half of this on 2 vCPUs)."""
    import statistics

    step = drafter.probe_step(len(context))
    target.prefill(torch.tensor(context))
    base = target.cache_len
    times = []
    for _ in range(reps + 2):  # two to warm up
        target.forward(torch.tensor(context[-1:]))
        t0 = time.perf_counter()
        step()
        times.append(1000 * (time.perf_counter() - t0))
        target.truncate(base)
    target.reset()
    return statistics.median(times[2:])
