"""The quantized-weights cache: written once, read back instead of re-rounding, and a damaged
file is a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adaspec.errors import ModelStoreError
from adaspec.store import quant_cache as quant_store
from adaspec.store.loaded import LoadedModel
from adaspec.store.loading import MARKER
from adaspec.store.quant_cache import QUANT_WEIGHTS, quant_cache_dir, quantize_loaded
from tests.conftest import tiny_model


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _loaded(tmp_path: Path, sha: str = "ab" * 32) -> LoadedModel:
    bf16_cache = tmp_path / "bf16"
    bf16_cache.mkdir(exist_ok=True)
    (bf16_cache / MARKER).write_text(json.dumps({"source_sha256": sha}))
    model = tiny_model(vocab=64, hidden=128, seed=3)
    return LoadedModel(model, None, "tiny", bf16_cache, "float32", bf16_cache)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(10).view(1, 10)
    with torch.inference_mode():
        return model(input_ids=ids).logits


def test_second_load_reads_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = quantize_loaded(_loaded(tmp_path), "int4")
    cache = quant_cache_dir("tiny", "int4")
    assert (cache / QUANT_WEIGHTS).is_file() and first.quant == "int4"

    def no_rounding(*_a, **_k):
        raise AssertionError("re-quantized although the cache was valid")

    monkeypatch.setattr(quant_store, "quantize_model", no_rounding)
    second = quantize_loaded(_loaded(tmp_path), "int4")
    assert torch.equal(_logits(first.model), _logits(second.model))


def test_other_source_is_not_served_from_the_cache(tmp_path: Path) -> None:
    quantize_loaded(_loaded(tmp_path), "int8")
    marker = json.loads((quant_cache_dir("tiny", "int8") / MARKER).read_text())
    quantize_loaded(_loaded(tmp_path, sha="cd" * 32), "int8")
    again = json.loads((quant_cache_dir("tiny", "int8") / MARKER).read_text())
    assert again["source_sha256"] == "cd" * 32 != marker["source_sha256"]


def test_truncated_cache_is_a_clear_error(tmp_path: Path) -> None:
    quantize_loaded(_loaded(tmp_path), "int8")
    weights = quant_cache_dir("tiny", "int8") / QUANT_WEIGHTS
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelStoreError, match="truncated or corrupt.*delete"):
        quantize_loaded(_loaded(tmp_path), "int8")


def test_garbled_cache_is_a_clear_error(tmp_path: Path) -> None:
    quantize_loaded(_loaded(tmp_path), "int8")
    weights = quant_cache_dir("tiny", "int8") / QUANT_WEIGHTS
    data = bytearray(weights.read_bytes())
    data[:8] = b"\xff" * 8  # the safetensors header length
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelStoreError, match="could not read quantized weights"):
        quantize_loaded(_loaded(tmp_path), "int8")


def test_checksum_verification_catches_a_flipped_byte(tmp_path: Path) -> None:
    quantize_loaded(_loaded(tmp_path), "int8")
    cache = quant_cache_dir("tiny", "int8")
    weights = cache / QUANT_WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelStoreError, match="checksum mismatch"):
        quant_store.verify_quant_cache(cache)
