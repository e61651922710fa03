"""The model store: built-in GGUF parts -> verified cache -> loaded torch model.

This is the one import for everything model-storage related:

    from adaspec.store.model_store import load_model, check_tokenizer_pair, prepare, assemble

Layout under `$ADASPEC_HOME` (default `~/.cache/adaspec`):

    gguf/<name>.gguf                 assembled built-in model, renamed into place only after
                                     its size and sha256 matched the catalog
    gguf/.hashes/<key>.json          sha256 of a GGUF keyed by path + size + mtime, so a second
                                     load does not re-hash a gigabyte (`verify` always re-hashes)
    models/<name>-<dtype>/           dense safetensors copy + config + tokenizer + adaspec.json

The work is split into `catalog` (the built-in table), `assembly` (parts -> GGUF) and
`loading` (GGUF / HF directory -> torch model via the cache); this module adds the status and
verification views the CLI shows and re-exports the public API. Every failure is a
`ModelStoreError` whose one-line message names the problem and the fix.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from adaspec.errors import ModelStoreError
from adaspec.store.assembly import (
    adaspec_home,
    assemble,
    cached_sha256,
    check_assembled,
    gguf_dir,
    gguf_path,
    human_size,
    locate_parts,
    models_dir,
    part_status,
    sha256_file,
)
from adaspec.store.catalog import (
    CATALOG,
    DRAFT_DEFAULT,
    TARGET_DEFAULT,
    ModelSpec,
    PartRef,
    get_spec,
    model_catalog,
)
from adaspec.store.loading import (
    DTYPES,
    MARKER,
    LoadedModel,
    PrepareResult,
    cache_dir_for,
    check_model_pair,
    check_tokenizer_pair,
    load_model,
    load_tokenizer,
    prepare,
    resolve_dtype,
    verify_cache_dir,
)
from adaspec.store.quant import QUANT_MODES
from adaspec.store.quant_cache import quant_cache_dir, verify_quant_cache

__all__ = [
    "DRAFT_DEFAULT", "DTYPES", "CATALOG", "TARGET_DEFAULT", "LoadedModel", "ModelSpec",
    "ModelStatus", "ModelStoreError", "PartRef", "PrepareResult", "VerifyResult",
    "adaspec_home", "assemble", "cache_dir_for", "cached_dtypes", "cached_sha256",
    "check_model_pair", "check_tokenizer_pair", "model_catalog", "get_spec", "gguf_dir",
    "gguf_path", "human_size", "list_models", "load_model", "load_tokenizer", "locate_parts",
    "model_status", "models_dir", "part_status", "prepare", "resolve_dtype", "sha256_file",
    "verify",
]


@dataclass
class ModelStatus:
    """What `adaspec models list` shows for one built-in model."""

    name: str
    role: str
    size: int
    description: str
    installed: bool
    missing: list[str]  # pip requirement strings of missing part packages
    install_hint: str
    assembled: bool
    cached_dtypes: list[str] = field(default_factory=list)


def cached_dtypes(name: str) -> list[str]:
    """Dtypes for which a complete safetensors cache of `name` exists (marker present)."""
    return [d for d in DTYPES if (models_dir() / f"{name}-{d}" / MARKER).is_file()]


def model_status(name: str, *, catalog: Mapping[str, ModelSpec] | None = None) -> ModelStatus:
    """Installed / assembled / cached state of one built-in model, without hashing anything."""
    spec = get_spec(name, catalog)
    _, missing = part_status(spec)
    path = gguf_path(spec.name)
    return ModelStatus(
        name=spec.name,
        role=spec.role,
        size=spec.size,
        description=spec.description,
        installed=not missing,
        missing=spec.pip_requirements([p.module for p in missing]),
        install_hint=spec.install_hint([p.module for p in missing] or None),
        assembled=path.is_file() and path.stat().st_size == spec.size,
        cached_dtypes=cached_dtypes(spec.name),
    )


def list_models(*, catalog: Mapping[str, ModelSpec] | None = None) -> list[ModelStatus]:
    """Status of every built-in model, in catalog order."""
    return [model_status(n, catalog=catalog) for n in model_catalog(catalog)]


@dataclass
class VerifyResult:
    """Outcome of re-hashing one model's assembled GGUF (and checking its caches)."""

    name: str
    ok: bool
    message: str
    seconds: float = 0.0
    path: Path | None = None
    checks: list[tuple[str, bool, str]] = field(default_factory=list)  # (what, ok, detail)


def verify(name: str, *, catalog: Mapping[str, ModelSpec] | None = None,
           progress: bool | None = None) -> VerifyResult:
    """Re-hash the assembled GGUF of `name` (never trusting the remembered hash) and check
    every safetensors cache of it against the hashes recorded when it was written.

    Returns a result rather than raising on a bad file, so the CLI can report every model.
    """
    spec = get_spec(name, catalog)
    path = gguf_path(spec.name)
    t0 = time.perf_counter()
    checks: list[tuple[str, bool, str]] = []
    if path.exists():
        try:
            sha = check_assembled(spec, path, rehash=True, progress=progress)
            checks.append(("gguf", True, f"sha256 {sha[:16]}..., {human_size(spec.size)}"))
        except ModelStoreError as exc:
            checks.append(("gguf", False, str(exc)))
    for dtype in cached_dtypes(spec.name):
        cache = models_dir() / f"{spec.name}-{dtype}"
        try:
            verify_cache_dir(cache, expected_source_sha=spec.sha256, progress=progress)
            checks.append((f"cache {dtype}", True, str(cache)))
        except ModelStoreError as exc:
            checks.append((f"cache {dtype}", False, str(exc)))
    for quant in QUANT_MODES[1:]:
        cache = quant_cache_dir(spec.name, quant)
        if not cache.is_dir():
            continue
        try:
            verify_quant_cache(cache)
            checks.append((f"cache {quant}", True, str(cache)))
        except ModelStoreError as exc:
            checks.append((f"cache {quant}", False, str(exc)))
    seconds = time.perf_counter() - t0
    if not checks:
        return VerifyResult(
            spec.name, False,
            f"not assembled: run `adaspec models prepare {spec.name}`", seconds, None, checks,
        )
    bad = [detail for _, ok, detail in checks if not ok]
    message = bad[0] if bad else "; ".join(f"{what} OK" for what, _, _ in checks)
    return VerifyResult(spec.name, not bad, message, seconds, path, checks)
