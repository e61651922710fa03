"""What the one-file source patches of ik_llama.cpp share (`ik/patches/prefetch.py`,
`ik/patches/two_groups.py`, `ik/patches/hugepages.py`; `ik/build.py` applies them)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


class PatchError(Exception):
    """The source lacks what a patch expects (another ik_llama.cpp version)."""


def patch_file(src: Path, file: str, patch: Callable[[str], str]) -> str:
    """Patch `src / file` in place with `patch` (text in, text out; unchanged when already
    applied, so a resumed build changes nothing), atomically; returns the patched text."""
    from adaspec.store.atomic import write_text

    path = src / file
    try:
        text = path.read_text()
    except OSError as exc:
        raise PatchError(f"unreadable source ({exc})") from None
    patched = patch(text)
    if patched != text:
        write_text(path, patched)
    return patched
