"""The router's offline data: prompt splits, and the table the policy trains on.

A collection folder holds `collect.json` (arms, target, parameter counts, settings),
`runs/` (a bench run of every arm side by side: results.jsonl, summary, plots) and
`states.jsonl` (per prompt: the target's final hidden state of the prompt and, for plain
decoding's similarity, a sampled target output). A features folder (test prompts) holds only
`states.jsonl`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from adaspec.errors import InputError
from adaspec.lab.bench.report import decode_seconds
from adaspec.lab.bench.runner import RESULTS, read_rows
from adaspec.lab.router.reward import COSTS, priced_decode_ms, rouge_l
from adaspec.methods.spec import parse_method

if TYPE_CHECKING:
    from adaspec.cost.profile import CostProfile

META = "collect.json"
STATES = "states.jsonl"
RUNS = "runs"
def read_states(folder: str | Path) -> dict[str, dict]:
    """prompt id -> states.jsonl row (the last one wins; a line cut off by a kill is skipped)."""
    path = Path(folder) / STATES
    rows: dict[str, dict] = {}
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "prompt_id" in row and "state" in row:
            rows[row["prompt_id"]] = row
    return rows


def read_meta(folder: str | Path) -> dict:
    path = Path(folder) / META
    if not path.is_file():
        raise InputError(f"{path} not found: is {folder} a folder from `adaspec router collect`?")
    return json.loads(path.read_text(encoding="utf-8"))


@dataclass
class RouterData:
    """Prompts x arms, in the arms' order; times are ms per new token of each measured run:
    end to end (what the bench reports) and decode only (prefill taken out: the part an arm
    controls, which the measured reward reads)."""

    arms: list[str]
    methods: dict[str, str]  # arm name -> method string
    prompt_ids: list[str]
    categories: list[str]
    states: np.ndarray  # [N, hidden]
    similarity: np.ndarray  # [N, A] Rouge-L against the target's greedy output
    ms_per_token: np.ndarray  # [N, A]
    decode_ms_per_token: np.ndarray  # [N, A]
    ar_ms_per_token: np.ndarray  # [N] plain decoding, the denominator of every speedup
    params: list[int]  # per arm, the paper's cost input
    target: str
    rows: dict[tuple[str, str], dict]  # (prompt id, arm) -> the bench row
    # [N, A] decode ms per token of the same runs priced by a cost profile (`with_profile`),
    # what the `profile` reward reads; None until priced
    profile_ms_per_token: np.ndarray | None = None
    profile_source: str = ""

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def costs(self) -> list[str]:
        """The rewards' costs this table can give (`profile` once priced)."""
        return [c for c in COSTS if c != "profile" or self.profile_ms_per_token is not None]

    def with_profile(self, profile: CostProfile) -> RouterData:
        """This table with every arm's runs priced by `profile` (`reward.priced_decode_ms`
        per new token), for the `profile` reward."""
        priced = np.zeros((len(self), len(self.arms)))
        for j, arm in enumerate(self.arms):
            spec = parse_method(self.methods[arm])
            branching = spec.tree
            for i, p in enumerate(self.prompt_ids):
                row = self.rows[(p, arm)]
                priced[i, j] = priced_decode_ms(row, profile, branching) / row["new_tokens"]
        source = profile.source + (" (simulated)" if profile.simulated else "")
        return replace(self, profile_ms_per_token=priced, profile_source=source)

    @property
    def speedup(self) -> np.ndarray:
        return self.ar_ms_per_token[:, None] / self.ms_per_token

    def subset(self, index) -> RouterData:
        idx = np.asarray(index, dtype=int)
        keep = {self.prompt_ids[i] for i in idx}
        return RouterData(
            arms=self.arms,
            methods=self.methods,
            prompt_ids=[self.prompt_ids[i] for i in idx],
            categories=[self.categories[i] for i in idx],
            states=self.states[idx],
            similarity=self.similarity[idx],
            ms_per_token=self.ms_per_token[idx],
            decode_ms_per_token=self.decode_ms_per_token[idx],
            ar_ms_per_token=self.ar_ms_per_token[idx],
            params=self.params,
            target=self.target,
            rows={k: v for k, v in self.rows.items() if k[0] in keep},
            profile_ms_per_token=None
            if self.profile_ms_per_token is None
            else self.profile_ms_per_token[idx],
            profile_source=self.profile_source,
        )


def _ms(row: dict, decode_only: bool = False) -> float:
    """ms per new token of a bench row; decode_only takes the prompt's prefill out (the same
    work for every arm, whose timing noise would otherwise blur the arms' differences)."""
    if not row["new_tokens"]:
        return float("nan")
    seconds = decode_seconds(row) if decode_only else row["wall_time"]
    return 1000.0 * seconds / row["new_tokens"]


def load_data(
    runs: str | Path,
    states: str | Path,
    arms: dict[str, str],
    params: list[int] | None = None,
    target: str = "",
) -> RouterData:
    """Join a bench run's rows (every arm and `ar` on each prompt) with prompt states; only
    prompts complete in both are kept. Plain decoding's similarity is its sampled output's
    Rouge-L against the greedy one when a sample was recorded, else 1."""
    plain = {a for a, m in arms.items() if parse_method(m).name == "ar"}
    rows, _ = read_rows(Path(runs) / RESULTS)
    if not rows:
        raise InputError(f"no bench rows in {Path(runs) / RESULTS}")
    by_key = {(r["prompt_id"], r["method"]): r for r in rows if int(r.get("repeat", 0)) == 0}
    state_rows = read_states(states)
    order = list(dict.fromkeys(r["prompt_id"] for r in rows))
    keep = [
        p
        for p in order
        if p in state_rows
        and (p, "ar") in by_key
        and all((p, a) in by_key and by_key[(p, a)]["new_tokens"] for a in arms)
    ]
    if not keep:
        raise InputError(
            f"no prompt has both a prompt state ({Path(states) / STATES}) and a run of every "
            f"arm {arms} ({Path(runs) / RESULTS})"
        )
    sim = np.ones((len(keep), len(arms)))
    ms = np.zeros((len(keep), len(arms)))
    decode_ms = np.zeros((len(keep), len(arms)))
    for i, p in enumerate(keep):
        ref = by_key[(p, "ar")]["token_ids"]
        sample = state_rows[p].get("sample_token_ids")
        for j, a in enumerate(arms):
            row = by_key[(p, a)]
            ms[i, j] = _ms(row)
            decode_ms[i, j] = _ms(row, decode_only=True)
            if a in plain and sample is not None:
                sim[i, j] = rouge_l(ref, sample)
            elif a not in plain:
                sim[i, j] = rouge_l(ref, row["token_ids"])
    return RouterData(
        arms=list(arms),
        methods=dict(arms),
        prompt_ids=keep,
        categories=[by_key[(p, "ar")].get("category", "all") for p in keep],
        states=np.asarray([state_rows[p]["state"] for p in keep], dtype=np.float32),
        similarity=sim,
        ms_per_token=ms,
        decode_ms_per_token=decode_ms,
        ar_ms_per_token=np.asarray([_ms(by_key[(p, "ar")]) for p in keep]),
        params=list(params) if params is not None else [0] * len(arms),
        target=target,
        rows={k: v for k, v in by_key.items() if k[0] in keep},
    )


def load_collection(folder: str | Path) -> RouterData:
    """The training table of a `router collect` folder."""
    meta = read_meta(folder)
    return load_data(
        Path(folder) / RUNS, folder, dict(meta["arms"]), meta.get("params"), meta["target"]
    )
