"""Draft heads shipped for the built-in target (`head` without `artifact=`), each beside a
`.json` with its provenance (the commands, the training data's checksum, the date and the
machine); `docs/head.md` says how to make one for another target."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent


def head_file(target: str) -> Path:
    return HERE / f"head-{target}.pt"
