"""`adaspec router collect`: the offline data the router is trained on.

Phase 1 runs every arm (and plain decoding, the reference) side by side on each training
prompt with the bench runner: warm-up, arms alternating prompt by prompt, greedy outputs,
measured times, exactness against plain decoding, resumable `runs/results.jsonl`. Phase 2
records per prompt the target's final hidden state of the prompt and a sampled target output
(plain decoding's similarity, as in the paper), appended to `states.jsonl` as each prompt
finishes, so an interrupted collection resumes where it stopped.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from adaspec.backends.base import ModelBackend
from adaspec.core.sampling import SamplingParams
from adaspec.engine.loop import TextGenerator
from adaspec.errors import InputError
from adaspec.lab.bench.runner import BenchConfig, BenchRunner
from adaspec.lab.bench.suites import Prompt
from adaspec.lab.router.collection import META, RUNS, STATES, read_states
from adaspec.methods.arms import arm_parameters, check_arms, count_parameters
from adaspec.methods.build import build_arm_generators
from adaspec.route.router import prompt_state
from adaspec.store.atomic import trim_torn_tail, write_json

# Settings that change what a collected row means: a resumed collection must match them.
MATCH_KEYS = ("arms", "target", "draft", "dtype", "weights", "max_new_tokens",
              "sample_temperature")
# `weights` was called `quant` (and `fastest` `auto`) in collections before issue 32.
_OLD_NAMES = {"weights": "quant"}


@dataclass
class CollectConfig:
    arms: dict[str, str]
    out: str
    max_new_tokens: int = 48
    sample_temperature: float = 1.0  # plain decoding's sampled output (0: no sample)
    seed: int = 0
    overwrite: bool = False
    dtype: str = ""
    weights: tuple[str, str] = ("none", "none")  # target, draft weights (backends/weights.py)


def _check_meta(folder: Path, meta: dict, overwrite: bool) -> None:
    path = folder / META
    if overwrite or not path.exists():
        return
    before = collection_settings(json.loads(path.read_text(encoding="utf-8")))
    diff = [k for k in MATCH_KEYS if before.get(k) != meta.get(k)]
    if diff:
        what = ", ".join(f"{k} was {before.get(k)!r}, now {meta.get(k)!r}" for k in diff)
        raise InputError(
            f"{folder} holds a collection with other settings ({what}): use the same "
            "settings, --overwrite, or another --out"
        )


def collection_settings(meta: dict) -> dict:
    """A collect.json as this version names its settings: an older one's `quant` is
    `weights` (its value `auto` is `fastest`)."""
    from adaspec.backends.weights import read_weights

    meta = dict(meta)
    for new, old in _OLD_NAMES.items():
        if new not in meta and old in meta:
            value = meta.pop(old)
            meta[new] = [read_weights(v) for v in value] if isinstance(value, list) else value
    return meta


def record_states(
    prompts: list[Prompt],
    engine: TextGenerator,
    out: Path,
    max_new_tokens: int = 0,
    sample_temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, dict]:
    """Append each new prompt's state (first turn) and, if sample_temperature > 0, a sampled
    plain-decoding output to out/states.jsonl; returns every recorded row."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    if trim_torn_tail(out / STATES):  # a row cut off by a kill: the next append starts clean
        print(f"adaspec: dropped 1 incomplete line from {out / STATES}", file=sys.stderr)
    done = read_states(out)
    todo = [p for p in prompts if p.id not in done]
    target = engine.target
    with (
        (out / STATES).open("a", encoding="utf-8") as f,
        tqdm(todo, desc="prompt states", disable=not progress, file=sys.stderr) as bar,
    ):
        for p in bar:
            ids = engine.encode_prompt(p.all_turns[0])
            with torch.inference_mode():
                state = prompt_state(
                    target.prefill(torch.tensor(ids), hidden_layer=target.num_layers), target
                )
            row: dict = {
                "prompt_id": p.id,
                "category": p.category,
                "prompt_tokens": len(ids),
                "state": [round(float(v), 5) for v in state],
            }
            if sample_temperature > 0:
                res = engine.generate(
                    ids, max_new_tokens, SamplingParams(sample_temperature, seed=seed)
                )
                row.update(sample_temperature=sample_temperature, sample_token_ids=res.token_ids)
            f.write(json.dumps(row) + "\n")
            f.flush()
            done[p.id] = row
    return done


def collect(
    config: CollectConfig,
    prompts: list[Prompt],
    target: ModelBackend,
    tokenizer,
    draft: ModelBackend | None = None,
    eos_token_ids: list[int] | None = None,
    progress: bool = True,
) -> Path:
    """Run phase 1 and phase 2 over `prompts` into config.out; returns the folder."""
    specs = check_arms(config.arms)
    if config.max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {config.max_new_tokens}")
    if config.sample_temperature < 0:
        raise InputError("the sample temperature must be >= 0")
    out = Path(config.out)
    target_params = count_parameters(target) or 0
    draft_params = count_parameters(draft) if draft is not None else None
    meta = {
        "arms": dict(config.arms),
        "target": target.name,
        "draft": getattr(draft, "name", None),
        "dtype": config.dtype,
        # recorded only when used, so collections from before quantization still resume
        "weights": list(config.weights) if config.weights != ("none", "none") else None,
        "max_new_tokens": config.max_new_tokens,
        "sample_temperature": config.sample_temperature,
        "params": [arm_parameters(s, target_params, draft_params, target.name)
                   for s in specs.values()],
        "target_params": target_params,
        "draft_params": draft_params,
    }
    _check_meta(out, meta, config.overwrite)
    out.mkdir(parents=True, exist_ok=True)
    if config.overwrite and (out / STATES).exists():
        (out / STATES).unlink()
    write_json(out / META, meta)

    engines = build_arm_generators(config.arms, target, tokenizer, draft, eos_token_ids)
    custom = {name: e for name, e in engines.items() if name != config.arms[name]}
    runner = BenchRunner(
        BenchConfig(
            methods=list(config.arms),
            suites=["router-train"],
            max_new_tokens=config.max_new_tokens,
            seed=config.seed,
            out=str(out / RUNS),
            resume=not config.overwrite,
            overwrite=config.overwrite,
            target=target.name,
            draft=str(getattr(draft, "name", "")),
            dtype=config.dtype,
            weights=config.weights[0],
            draft_weights=config.weights[1],
        ),
        target,
        tokenizer,
        draft,
        eos_token_ids,
        engines=custom,
        progress=progress,
    )
    runner.run(prompts)
    record_states(
        prompts,
        runner.engines["ar"],
        out,
        config.max_new_tokens,
        config.sample_temperature,
        config.seed,
        progress,
    )
    return out
