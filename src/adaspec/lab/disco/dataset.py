"""DISCO training data: the target's greedy continuations and the draft's teacher-forced
features and labels at every position, split by prompt.

For each prompt the target decodes greedily (through an exact speculative engine, which
gives the same tokens as plain decoding, cheaper); then ONE teacher-forced draft pass over
prompt + continuation gives the draft's distribution at every position. Label i = the
draft's argmax equals the target's token i. The file keeps the distribution features
(`disco_features.distribution_features`), the labels, the tokens and the provenance; the
position features are added when rows are assembled (`rows`), because the position in the
current draft depends on the schedule being simulated.

A draft head (`lab/disco/head_data.py`) feeds its own states back along a chain, so its
distribution for a token depends on the token's position in the draft: its samples carry one
row per position, `dist` [n, D, F] and `hits` [n, D] (token i drafted at draft position d),
where a model draft's are [n, F] and [n] (the same at every position).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from adaspec.backends.base import ModelBackend
from adaspec.control.disco_features import (
    FeatureSpec,
    assemble,
    distribution_features,
    draft_positions,
)
from adaspec.errors import InputError
from adaspec.lab.bench.suites import Prompt
from adaspec.lab.bench.theory import teacher_forced_logits
from adaspec.store.payloads import load_payload, save_payload

DATA_FORMAT = "adaspec-disco-data"
DATA_VERSION = 1
SPLITS = ("train", "val", "test")


@dataclass
class Sample:
    """One prompt: its tokens, the target's greedy output, the draft's features and labels."""

    prompt_id: str
    suite: str
    category: str
    split: str
    prompt_ids: list[int]
    output: list[int]
    dist: torch.Tensor  # [n, TOP_K + 1] (or [n, D, TOP_K + 1]) features for output[i]
    hits: torch.Tensor  # [n] (or [n, D]) bool: draft argmax == output[i]

    @property
    def depths(self) -> int:
        """Draft positions the sample describes apart (0: every position alike)."""
        return int(self.hits.shape[1]) if self.hits.dim() == 2 else 0

    def hit_table(self) -> list[bool] | list[list[bool]]:
        """The hits as Python lists, what the simulation reads (`simulate.hit_reader`)."""
        return self.hits.tolist()

    def to_dict(self) -> dict:
        return {**asdict(self), "dist": self.dist, "hits": self.hits}


@dataclass
class DiscoData:
    samples: list[Sample]
    provenance: dict = field(default_factory=dict)

    def split(self, name: str, suite: str | None = None) -> list[Sample]:
        return [s for s in self.samples if s.split == name and suite in (None, s.suite)]

    @property
    def suites(self) -> list[str]:
        return sorted({s.suite for s in self.samples})

    def save(self, path: str | Path) -> None:
        payload = {
            "format": DATA_FORMAT,
            "version": DATA_VERSION,
            "provenance": self.provenance,
            "samples": [s.to_dict() for s in self.samples],
        }
        save_payload(payload, path)

    @classmethod
    def load(cls, path: str | Path) -> DiscoData:
        payload = load_payload(path, DATA_FORMAT, "DISCO data file (adaspec disco collect)")
        try:
            samples = [Sample(**s) for s in payload["samples"]]
        except (KeyError, TypeError) as exc:
            raise InputError(f"{path}: DISCO data file is malformed ({exc})") from None
        return cls(samples=samples, provenance=dict(payload.get("provenance", {})))


def assign_splits(
    prompts: Sequence[tuple[str, Prompt]], fractions: Sequence[float], seed: int = 0
) -> dict[str, str]:
    """prompt id -> split, per (suite, category), shuffled with `seed`. Validation and test
    get round(n * fraction) prompts each but at least one when the category has 3 or more,
    so every category is tested; the rest train."""
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise InputError(f"split fractions must be three numbers >= 0 summing to 1: {fractions}")
    groups: dict[tuple[str, str], list[str]] = {}
    for suite, p in prompts:
        groups.setdefault((suite, p.category), []).append(p.id)
    out: dict[str, str] = {}
    rng = random.Random(seed)
    for key in sorted(groups):
        ids = sorted(groups[key])
        rng.shuffle(ids)
        n = len(ids)
        n_val, n_test = (
            (max(1, round(n * f)) if n >= 3 and f > 0 else round(n * f)) for f in fractions[1:]
        )
        for i, pid in enumerate(ids):
            out[pid] = "test" if i < n_test else "val" if i < n_test + n_val else "train"
    return out


GenerateFn = Callable[[Prompt], tuple[list[int], list[int]]]  # -> (prompt_ids, output)


def collect(
    prompts: Sequence[tuple[str, Prompt]],
    generate: GenerateFn,
    draft: ModelBackend,
    splits: dict[str, str],
    provenance: dict | None = None,
    progress: bool = True,
) -> DiscoData:
    """Greedy target output (`generate`) + one teacher-forced draft pass per prompt."""
    from tqdm import tqdm

    samples: list[Sample] = []
    t0 = time.perf_counter()
    for suite, prompt in tqdm(prompts, desc="disco collect", disable=not progress):
        prompt_ids, output = generate(prompt)
        if not output:
            continue
        logits = teacher_forced_logits(draft, prompt_ids, output)
        hits = logits.argmax(dim=-1) == torch.tensor(output)
        samples.append(
            Sample(
                prompt_id=prompt.id,
                suite=suite,
                category=prompt.category,
                split=splits[prompt.id],
                prompt_ids=list(prompt_ids),
                output=list(output),
                dist=distribution_features(logits),
                hits=hits,
            )
        )
    prov = dict(provenance or {})
    prov.update(
        prompts=len(samples),
        tokens=sum(len(s.output) for s in samples),
        collect_seconds=round(time.perf_counter() - t0, 1),
        splits={n: sorted(s.prompt_id for s in samples if s.split == n) for n in SPLITS},
    )
    return DiscoData(samples=samples, provenance=prov)


def rows(
    samples: Sequence[Sample], spec: FeatureSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training rows of drafted positions (token 0 comes from the prefill and is never
    drafted): features with the simulated position in the current draft, labels, and
    those draft positions (for the static baselines)."""
    xs, ys, ps = [], [], []
    for s in samples:
        if s.depths:
            x, y, p = _depth_rows(s, spec)
            xs.append(x)
            ys.append(y)
            ps.append(p)
            continue
        pos = draft_positions(s.hits)
        gen = torch.arange(len(s.hits))
        xs.append(assemble(s.dist, pos, gen, spec)[1:])
        ys.append(s.hits[1:])
        ps.append(pos[1:])
    if not xs:
        return torch.empty(0, spec.size), torch.empty(0, dtype=torch.bool), torch.empty(0)
    return torch.cat(xs), torch.cat(ys), torch.cat(ps)


def _depth_rows(s: Sample, spec: FeatureSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of a per-position sample: token i at draft position d wherever a draft can
    reach it (d = 0, or the d tokens before it accepted at positions 0 .. d - 1)."""
    hits = s.hits.bool()
    n, depth = hits.shape
    reach = torch.zeros(n, depth, dtype=torch.bool)
    reach[1:, 0] = True  # token 0 comes from the prefill
    for d in range(1, depth):
        reach[d + 1:, d] = reach[d:-1, d - 1] & hits[d:-1, d - 1]
    rows_at, depth_at = reach.nonzero(as_tuple=True)
    return (assemble(s.dist[rows_at, depth_at], depth_at, rows_at, spec),
            hits[rows_at, depth_at], depth_at)
