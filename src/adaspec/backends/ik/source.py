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


# an edit: (file, anchor, text, where): the text goes "before" or "after" the anchor, or
# "replace"s it; the anchor found exactly once
Edit = tuple[str, str, str, str]


def edit_texts(texts: dict[str, str], edits: list[Edit], mark: str, export: str
               ) -> dict[str, str]:
    """The files (path -> text) with `edits` applied and `export` appended to
    src/llama.cpp; files already carrying `mark` (a resumed build) come back unchanged.
    PatchError where an anchor is missing or not there once."""
    out = dict(texts)
    if any(mark in t for t in out.values()):
        return out
    for path, anchor, text, where in edits:
        body = out.get(path)
        if body is None:
            raise PatchError(f"{path}: missing")
        if body.count(anchor) != 1:
            raise PatchError(f"{path}: the anchor {anchor.strip()[:60]!r} is not there once")
        at = body.index(anchor) + (len(anchor) if where == "after" else 0)
        rest = at + len(anchor) if where == "replace" else at
        out[path] = body[:at] + text + body[rest:]
    out["src/llama.cpp"] += export
    return out


class SourcePatch:
    """A patch of several files given as `Edit`s and a C export appended to src/llama.cpp,
    recognised as applied by `mark` (`ik/patches/regions.py`, `ik/patches/tree.py`)."""

    def __init__(self, edits: list[Edit], mark: str, export: str) -> None:
        self.edits, self.mark, self.export = edits, mark, export
        self.files = sorted({path for path, *_ in edits})

    def patch_files(self, texts: dict[str, str]) -> dict[str, str]:
        """The files (path -> text) with the patch applied; files already patched come back
        unchanged. PatchError where an anchor is missing or not unique."""
        return edit_texts(texts, self.edits, self.mark, self.export)

    def apply(self, src: Path) -> int:
        """Patch the unpacked source in place (atomically, file by file); the edits made."""
        return apply_edits(src, self.files, self.patch_files, len(self.edits) + 1)
