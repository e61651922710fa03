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


def apply_edits(src: Path, files: list[str],
                patch_files: Callable[[dict[str, str]], dict[str, str]], edits: int) -> int:
    """Patch several files of the unpacked source in place with `patch_files` (texts in,
    texts out), atomically file by file; returns `edits`."""
    from adaspec.store.atomic import write_text

    try:
        texts = {f: (src / f).read_text() for f in files}
    except OSError as exc:
        raise PatchError(f"unreadable source ({exc})") from None
    patched = patch_files(texts)
    for f in files:
        if patched[f] != texts[f]:
            write_text(src / f, patched[f])
    return edits
