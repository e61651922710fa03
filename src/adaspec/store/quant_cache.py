"""Quantized weights on disk: `$ADASPEC_HOME/models/<name>-<mode>/`.

Rounding the 1.5B model's Linear layers takes seconds to tens of seconds; the result is
stored once (safetensors + a marker naming the source GGUF's sha256, the mode and the file's
size and sha256), so a quantized model then loads as fast as the bf16 cache it is built on:
the bf16 cache supplies embeddings, norms, config and tokenizer, the quantized file the
Linear layers.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from adaspec.errors import ModelStoreError
from adaspec.store.assembly import MARKER, ensure_free_space, models_dir, sha256_file
from adaspec.store.atomic import atomic_dir, clean_stale
from adaspec.store.loaded import LoadedModel
from adaspec.store.quant import check_quant, load_quantized_state, quantize_model

QUANT_FORMAT = 1
QUANT_WEIGHTS = "quantized.safetensors"


def quant_cache_dir(name: str, mode: str) -> Path:
    return models_dir() / f"{name}-{check_quant(mode)}"


def _source_sha(loaded: LoadedModel) -> str | None:
    if loaded.cache_dir is None:
        return None  # an HF directory: quantized in memory each time, nothing to key a cache on
    try:
        marker = json.loads((loaded.cache_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker.get("source_sha256")


def _current_marker(cache: Path, source_sha: str, mode: str) -> dict[str, Any] | None:
    try:
        marker = json.loads((cache / MARKER).read_text())
    except (OSError, ValueError):
        return None
    ok = (
        isinstance(marker, dict)
        and marker.get("format") == QUANT_FORMAT
        and marker.get("source_sha256") == source_sha
        and marker.get("mode") == mode
        and marker.get("torch") == torch.__version__
    )
    return marker if ok else None


def _read(cache: Path, marker: dict[str, Any], loaded: LoadedModel, mode: str) -> None:
    from safetensors.torch import load_file

    path = cache / QUANT_WEIGHTS
    fix = f"delete {cache} and load again to re-quantize"
    info = marker.get("files", {}).get(QUANT_WEIGHTS, {})
    if not path.is_file():
        raise ModelStoreError(f"{path} is missing: {fix}")
    if path.stat().st_size != info.get("size"):
        raise ModelStoreError(f"{path} is truncated or corrupt (size != marker's): {fix}")
    try:
        flat = load_file(str(path))
        load_quantized_state(loaded.model, mode, flat)
    except Exception as exc:  # a damaged file fails in safetensors or in the shape checks
        raise ModelStoreError(f"could not read quantized weights {path}: {exc}: {fix}") from exc


def _write(cache: Path, flat: dict[str, torch.Tensor], marker: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    cache.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(cache)  # a killed run's temp directory before counting free space
    need = sum(t.numel() * t.element_size() for t in flat.values())
    ensure_free_space(cache.parent, need, f"quantized cache {cache.name}")
    with atomic_dir(cache) as tmp:
        weights = tmp / QUANT_WEIGHTS
        save_file({k: v.contiguous() for k, v in flat.items()}, str(weights))
        files = {QUANT_WEIGHTS: {"size": weights.stat().st_size, "sha256": sha256_file(weights)}}
        (tmp / MARKER).write_text(json.dumps({**marker, "files": files}, indent=2) + "\n")


def verify_quant_cache(cache: Path) -> dict[str, Any]:
    """Re-hash a quantized cache against its marker (for `adaspec models verify`)."""
    fix = f"delete {cache} and load again to re-quantize"
    try:
        marker = json.loads((cache / MARKER).read_text())
    except (OSError, ValueError):
        raise ModelStoreError(f"{cache} has no valid {MARKER}: {fix}") from None
    for fname, info in marker.get("files", {}).items():
        got = sha256_file(cache / fname) if (cache / fname).is_file() else None
        if got != info.get("sha256"):
            raise ModelStoreError(f"checksum mismatch for {cache / fname}: {fix}")
    return marker


def quantize_loaded(loaded: LoadedModel, mode: str) -> LoadedModel:
    """Quantize a loaded bf16 model in place, through the disk cache when it has a source."""
    check_quant(mode)
    if mode == "none":
        return loaded
    t0 = time.perf_counter()
    sha = _source_sha(loaded)
    if sha is None:
        quantize_model(loaded.model, mode)
    else:
        cache = quant_cache_dir(loaded.name, mode)
        marker = _current_marker(cache, sha, mode)
        if marker is not None:
            _read(cache, marker, loaded, mode)
        else:
            flat = quantize_model(loaded.model, mode)
            _write(cache, flat, {
                "format": QUANT_FORMAT, "name": loaded.name, "mode": mode,
                "source_sha256": sha, "torch": torch.__version__,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            })
    loaded.quant = mode
    loaded.load_seconds += time.perf_counter() - t0
    return loaded
