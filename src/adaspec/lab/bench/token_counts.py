"""Token counts over the target's real outputs in bench results: what `adaspec models
restrict-vocab` keeps in a restricted draft head (`store/token_set.py` stores the set)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from adaspec.errors import InputError
from adaspec.store.assembly import sha256_file

COUNTED_METHODS = ("ar", "llamacpp")  # plain decoding of the target: its real outputs


def _settings(results: Path) -> dict:
    run = results.parent / "run.json"
    try:
        return json.loads(run.read_text()).get("settings", {})
    except (OSError, ValueError):
        return {}


def count_target_outputs(
    results: list[Path], target: str | None, exclude_prompts: Iterable[str] = ()
) -> tuple[Counter, dict]:
    """Token counts over the target's outputs in bench `results.jsonl` files.

    Rows of plain decoding (COUNTED_METHODS) only. A prompt's output seen in several files
    counts once: an output that is a prefix of another kept output of the same prompt is a
    shorter run of the same decoding. Files whose run.json names another target are skipped
    (other token ids). Returns (counts, provenance)."""
    excluded = set(exclude_prompts)
    outputs: dict[str, list[tuple[int, ...]]] = {}
    sources: list[dict[str, Any]] = []
    for path in results:
        if not path.is_file():
            raise InputError(f"results file not found: {path}")
        settings = _settings(path)
        if target and settings.get("target") not in (None, target):
            sources.append({"path": str(path), "skipped": f"target {settings['target']}"})
            continue
        used = 0
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut off by a killed run
            if not isinstance(row, dict) or row.get("method") not in COUNTED_METHODS:
                continue
            pid = str(row.get("prompt_id"))
            if pid in excluded or not row.get("token_ids"):
                continue
            used += 1
            out = tuple(int(t) for t in row["token_ids"])
            kept = outputs.setdefault(pid, [])
            if any(k[: len(out)] == out for k in kept):
                continue
            kept[:] = [k for k in kept if out[: len(k)] != k] + [out]
        sources.append(
            {
                "path": str(path),
                "sha256": sha256_file(path),
                "rows": used,
                "temperature": settings.get("temperature"),
            }
        )
    counts: Counter = Counter()
    for outs in outputs.values():
        for out in outs:
            counts.update(out)
    provenance = {
        "methods": list(COUNTED_METHODS),
        "sources": sources,
        "excluded_prompts": sorted(excluded),
        "prompts": len(outputs),
        "outputs": sum(len(o) for o in outputs.values()),
        "tokens": sum(counts.values()),
        "distinct": len(counts),
    }
    return counts, provenance
