"""Atomic writes: a reader, a later run or a crash never sees half a file.

Every file a user or a later run reads (bench results and summaries, DISCO and router
artifacts, cost profiles, the model caches and their markers) is written here: the bytes go
to a temp file in the same directory, named `.NAME.tmp-PID-XXXX` (never the final name),
which is flushed, fsynced and only then `os.replace`d onto NAME. A failure or a kill at any
point leaves the old file or the new one, never a torn one; the temp file of a failure is
removed at once, that of a killed process by the next write of the same name.

A directory (the safetensors caches) is built in a temp directory the same way and renamed
into place by `replace_dir`. Files that grow row by row for resumability (results.jsonl,
states.jsonl) are appended to instead; `trim_torn_tail` makes such a file safe to append to
again after a kill cut its last line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def temp_path(final: str | os.PathLike[str], kind: str = "tmp") -> Path:
    """A fresh hidden name beside `final` (same directory, so the rename is atomic)."""
    final = Path(final)
    return final.with_name(f".{final.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def _owner_pid(leftover: Path) -> int | None:
    try:
        return int(leftover.name.rsplit("-", 2)[-2])
    except (ValueError, IndexError):
        return None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def clean_stale(final: str | os.PathLike[str]) -> None:
    """Remove what writes of `final` by dead processes (kill -9, power loss) left behind:
    temp files or directories, and an old directory moved aside by `replace_dir` (put back
    if the kill fell between its two renames, so the old copy is not lost)."""
    final = Path(final)
    if not final.parent.is_dir():
        return
    for kind in ("old", "tmp"):
        for leftover in final.parent.glob(f".{final.name}.{kind}-*"):
            pid = _owner_pid(leftover)
            if pid is None or pid_alive(pid):
                continue
            if kind == "old" and not final.exists():
                try:
                    os.replace(leftover, final)
                    continue
                except OSError:
                    pass
            _remove(leftover)


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Make a rename in `folder` durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: Path, final: Path) -> None:
    os.replace(tmp, final)
    fsync_dir(final.parent)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temp path to write the new `path` to (for writers that take a file name, such
    as safetensors' save_file); when the block ends normally the file is fsynced and renamed
    onto `path`; if it raises, the temp file is removed and `path` is left as it was."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(final)
    tmp = temp_path(final)
    try:
        yield tmp
        _fsync_file(tmp)
        _commit(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w",
                encoding: str | None = None) -> Iterator[IO[Any]]:
    """`open(path, mode)` for a whole new file ("w" or "wb"), made atomic: the file object
    writes a temp file, which replaces `path` only when the block ends normally."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', not {mode!r}")
    if mode == "w" and encoding is None:
        encoding = "utf-8"
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(final)
    tmp = temp_path(final)
    # O_EXCL: never write through a file (or link) someone else put there; 0o666 & umask as
    # open() would give the final file
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with open(fd, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _commit(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    with atomic_open(path, "wb") as f:
        f.write(data)
    return Path(path)


def write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    with atomic_open(path, "w", encoding=encoding) as f:
        f.write(text)
    return Path(path)


def write_json(path: str | os.PathLike[str], obj: Any, indent: int | None = 2) -> Path:
    """`obj` as JSON plus a final newline (serialized before anything is written: an object
    json cannot encode leaves `path` untouched)."""
    return write_text(path, json.dumps(obj, indent=indent) + "\n")


# ----------------------------------------------------------------------------- directories


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a new temp directory to fill; when the block ends normally its files are fsynced
    and it replaces the directory `path` (`replace_dir`); if it raises, it is removed."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(final)
    tmp = temp_path(final)
    tmp.mkdir()
    try:
        yield tmp
        replace_dir(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(tmp: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """Rename a finished directory into place, moving any old one aside first.

    Its files are fsynced first, so the rename never publishes data still in flight. Between
    the two renames `final` is briefly absent (a reader sees no cache, never half of one); a
    kill there leaves the old copy aside, which `clean_stale` puts back.
    """
    tmp, final = Path(tmp), Path(final)
    for item in tmp.rglob("*"):
        if item.is_file() and not item.is_symlink():
            _fsync_file(item)
    fsync_dir(tmp)
    old = None
    if final.exists():
        old = temp_path(final, "old")
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:  # put the old copy back rather than leave nothing
            with contextlib.suppress(OSError):
                os.replace(old, final)
        # If even that failed, the old copy stays aside: `clean_stale` restores it later.
        raise
    if old is not None:  # the new copy is in place: the old one can go
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(final.parent)


# ----------------------------------------------------------------------------- append-only files


def trim_torn_tail(path: str | os.PathLike[str]) -> int:
    """Make an append-only .jsonl file safe to append to after a kill: a last line without
    its newline (a write cut off mid-row) is removed if it is not valid JSON, completed with
    its newline if it is. Returns the number of lines removed (0 or 1)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size == 0:
                return 0
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return 0
            # find the start of the last line (blocks back from the end)
            start, pos = 0, size
            while pos > 0:
                step = min(pos, 1 << 16)
                pos -= step
                f.seek(pos)
                block = f.read(step)
                cut = block.rfind(b"\n")
                if cut >= 0:
                    start = pos + cut + 1
                    break
            f.seek(start)
            tail = f.read()
    except FileNotFoundError:
        return 0
    try:
        json.loads(tail)
        whole = True
    except ValueError:  # JSONDecodeError and UnicodeDecodeError alike
        whole = False
    with path.open("r+b") as f:
        if whole:
            f.seek(0, os.SEEK_END)
            f.write(b"\n")
        else:
            f.truncate(start)
        f.flush()
        os.fsync(f.fileno())
    return 0 if whole else 1


__all__ = [
    "atomic_dir", "atomic_open", "atomic_path", "clean_stale", "fsync_dir", "pid_alive",
    "replace_dir", "temp_path", "trim_torn_tail", "write_bytes", "write_json", "write_text",
]
