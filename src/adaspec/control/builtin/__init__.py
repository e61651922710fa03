"""Trained artifacts shipped with adaspec for the built-in model pair, so the methods that
need one work right after install: the DISCO classifier (`draft:ctrl=disco` without
`disco=`). Each file sits beside a `.json` with its provenance (the commands, the training
data's sha256, the date and machine); `docs/disco.md` says how to make one for another
pair."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
DISCO_BUILTIN = HERE / "disco-qwen2.5-coder-1.5b-instruct+qwen2.5-coder-0.5b-instruct.pt"


def provenance(artifact: Path) -> dict:
    """The `.json` beside a shipped artifact ({} when there is none)."""
    try:
        return json.loads(artifact.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return {}
