"""S2D training data: a target's own greedy outputs on training prompts.

One folder per target: `outputs.jsonl` (one row per prompt: id, suite, category, split,
prompt ids, output ids), appended as each prompt finishes so a killed run resumes where it
stopped, and `data.json` (the target, the generation settings, the sources and, once done,
the sha256 of the rows). Training prompts are the ones DESIGN.md lets train
(`suites.training_prompts`), never a prompt the bench reports a speedup for.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from adaspec.errors import InputError
from adaspec.lab.bench.suites import Prompt
from adaspec.store.assembly import sha256_file
from adaspec.store.atomic import trim_torn_tail, write_json

ROWS = "outputs.jsonl"
META = "data.json"
DEFAULT_SUITES = "sharegpt:160,humaneval:60,wmt:60,spec-bench:4"


@dataclass
class Row:
    prompt_id: str
    suite: str
    category: str
    split: str
    prompt_ids: list[int]
    output: list[int]


def split_of(prompt_id: str, val_fraction: float, seed: int = 0) -> str:
    """A stable train/val split by prompt id (the same id always lands in the same split)."""
    h = hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()
    return "val" if int.from_bytes(h[:8], "big") / 2**64 < val_fraction else "train"


def read_rows(folder: str | Path) -> list[Row]:
    path = Path(folder) / ROWS
    if not path.is_file():
        raise InputError(f"no {ROWS} in {folder}: collect it with `adaspec s2d data`")
    rows: list[Row] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(Row(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue  # a line cut off by a kill
    return rows


def read_meta(folder: str | Path) -> dict:
    path = Path(folder) / META
    if not path.is_file():
        raise InputError(f"{path} not found: is {folder} a folder from `adaspec s2d data`?")
    return json.loads(path.read_text(encoding="utf-8"))


def collect(
    prompts: Sequence[tuple[str, Prompt]],
    engine,
    target_name: str,
    out: str | Path,
    max_new_tokens: int,
    method: str,
    val_fraction: float = 0.1,
    max_prompt_tokens: int = 384,
    progress: bool = True,
) -> Path:
    """Greedy outputs of `engine` (an exact engine of the target) for each (suite, prompt);
    resumes an earlier run of the same settings."""
    from tqdm import tqdm

    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0 <= val_fraction < 1:
        raise InputError(f"the validation fraction must be in [0, 1), got {val_fraction}")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"target": target_name, "max_new_tokens": max_new_tokens, "method": method,
            "val_fraction": val_fraction, "max_prompt_tokens": max_prompt_tokens}
    if (folder / META).is_file():
        old = read_meta(folder)
        diff = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
        if diff:
            raise InputError(f"{folder} holds data collected with other settings "
                             f"({diff}): use another --out")
    rows_path = folder / ROWS
    if rows_path.exists():
        trim_torn_tail(rows_path)
    done = {r.prompt_id for r in read_rows(folder)} if rows_path.exists() else set()
    todo = [(s, p) for s, p in prompts if p.id not in done]
    write_json(folder / META, {**meta, "complete": False})
    t0 = time.perf_counter()
    tokens = 0
    with rows_path.open("a", encoding="utf-8") as f:
        bar = tqdm(todo, desc=f"s2d data ({target_name})", disable=not progress, unit="prompt")
        for suite, prompt in bar:
            room = min(max_prompt_tokens, engine.max_context - max_new_tokens)
            ids = engine.encode_prompt(prompt.text)[-max(1, room):]
            res = engine.generate(ids, max_new_tokens=max_new_tokens)
            row = Row(prompt.id, suite, prompt.category, split_of(prompt.id, val_fraction),
                      list(ids), list(res.token_ids))
            f.write(json.dumps(row.__dict__) + "\n")
            f.flush()
            tokens += len(res.token_ids)
            bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - t0, 1e-9):.1f}")
    rows = read_rows(folder)
    by_suite: dict[str, int] = {}
    for r in rows:
        by_suite[r.suite] = by_suite.get(r.suite, 0) + 1
    write_json(folder / META, {
        **meta, "complete": True, "rows": len(rows), "rows_by_suite": by_suite,
        "output_tokens": sum(len(r.output) for r in rows),
        "train_rows": sum(r.split == "train" for r in rows),
        "val_rows": sum(r.split == "val" for r in rows),
        "rows_sha256": sha256_file(rows_path, progress=False),
    })
    return folder


def training_prompt_pairs(suites: list[tuple[str, int | None]], seed: int = 0
                          ) -> list[tuple[str, Prompt]]:
    """(suite, prompt) for the training prompts of each suite, shuffled across suites so a
    partial collection still mixes them."""
    from adaspec.lab.bench.suites import training_prompts

    pairs = [(name, p) for name, limit in suites for p in training_prompts([(name, limit)])]
    random.Random(seed).shuffle(pairs)
    return pairs


def default_data_dir(target: str) -> Path:
    """Where `adaspec s2d data` writes a target's outputs by default."""
    from adaspec.draft.s2d_artifact import s2d_home
    from adaspec.store.loading import source_name

    return s2d_home() / "data" / source_name(target)
