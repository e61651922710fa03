"""Trained artifacts shipped with adaspec for the built-in model pair, so the methods that
need one work right after install: the DISCO classifiers (`draft:ctrl=disco` and
`head:ctrl=disco` without `disco=`). Each file sits beside a `.json` with its provenance
(the commands, the training data's sha256, the date and machine); `docs/disco.md` and
`docs/head.md` say how to make one for another pair."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
DISCO_BUILTIN = HERE / "disco-qwen2.5-coder-1.5b-instruct+qwen2.5-coder-0.5b-instruct.pt"


def head_disco_file(target: str) -> Path:
    """The DISCO classifier of the draft head shipped for `target` (`head:ctrl=disco`)."""
    return HERE / f"disco-{target}+head.pt"


def provenance(artifact: Path) -> dict:
    """The `.json` beside a shipped artifact ({} when there is none)."""
    try:
        return json.loads(artifact.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return {}
