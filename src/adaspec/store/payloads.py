"""Reading and writing DISCO's files (data, artifact): torch.save of plain dicts and
tensors, loaded with weights_only so no code runs, every failure a one-line InputError."""

from __future__ import annotations

from pathlib import Path

import torch

from adaspec.errors import InputError
from adaspec.store.atomic import atomic_open


def save_payload(payload: dict, path: str | Path) -> None:
    """Write atomically: a killed run never leaves half a file under the real name."""
    with atomic_open(path, "wb") as f:
        torch.save(payload, f)


def load_payload(path: str | Path, fmt: str, what: str) -> dict:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} not found: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # zip, pickle and EOF errors alike: the file is not ours or cut
        raise InputError(
            f"{path}: not a readable {what} ({type(exc).__name__}); recreate it"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != fmt:
        raise InputError(f"{path}: not a {what}")
    return payload
