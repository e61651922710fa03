"""GGUF / Hugging Face directory -> a torch CausalLM, through a safetensors cache.

Dequantizing a GGUF with transformers takes 30-45 s for the 1.5B model, so the first load
writes the dense weights as safetensors under `$ADASPEC_HOME/models/<name>-<dtype>/` (plus
config, generation config, tokenizer and a marker naming the source sha256); later loads read
that directory in a few seconds. `save_pretrained` refuses GGUF-loaded models, so the state
dict is written with `safetensors` directly, dropping tied duplicates that `from_pretrained`
re-ties from the config. Nothing here ever contacts a model hub.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adaspec.errors import ModelStoreError
from adaspec.store.assembly import (
    MARKER,
    assemble,
    cached_sha256,
    check_gguf_magic,
    ensure_free_space,
    models_dir,
    sha256_file,
)
from adaspec.store.atomic import atomic_dir, clean_stale
from adaspec.store.catalog import (
    CATALOG,
    DRAFT_DEFAULT,
    TARGET_DEFAULT,
    ModelSpec,
    get_spec,
    model_catalog,
)
from adaspec.store.loaded import LoadedModel, PrepareResult

# Never reach for a hub, whatever a caller forgets to pass (the user's explicit setting wins).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float16": torch.float16,
}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "float": "float32",
                  "fp16": "float16", "half": "float16"}
CACHE_FORMAT = 1
WEIGHTS = "model.safetensors"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_dtype(dtype: str | torch.dtype) -> tuple[str, torch.dtype]:
    """'bfloat16' / 'bf16' / torch.bfloat16 -> ('bfloat16', torch.bfloat16); else a clear error."""
    if isinstance(dtype, torch.dtype):
        for name, value in DTYPES.items():
            if value == dtype:
                return name, value
    elif isinstance(dtype, str):
        key = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
        if key in DTYPES:
            return key, DTYPES[key]
    raise ModelStoreError(
        f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}"
    )


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


# ----------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class _Source:
    kind: str  # "builtin", "gguf" or "hf"
    name: str
    path: Path | None  # the .gguf file or HF directory (None for a built-in not assembled yet)
    sha256: str | None  # of the GGUF (None for an HF directory)


def _resolve_source(spec: str | os.PathLike[str], catalog: Mapping[str, ModelSpec] | None,
                    progress: bool | None) -> _Source:
    """Decide what `spec` names: a built-in model, a .gguf file or an HF model directory."""
    reg = model_catalog(catalog)
    text = os.fspath(spec)
    if isinstance(spec, str) and text in reg:
        entry = reg[text]
        return _Source("builtin", entry.name, None, entry.sha256)
    path = Path(text).expanduser()
    if not path.exists():
        if isinstance(spec, str) and os.sep not in text and not text.endswith(".gguf"):
            get_spec(text, reg)  # raises "unknown model ..., use one of ..."
        raise ModelStoreError(
            f"model path {path} does not exist (nothing is downloaded from a model hub): check "
            f"the path, or use a built-in model name ({', '.join(sorted(reg))})"
        )
    path = path.resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            hint = f"; to load the GGUF pass {ggufs[0]}" if ggufs else ""
            raise ModelStoreError(
                f"{path} is not a Hugging Face model directory (no config.json){hint}: "
                "pass a directory written by save_pretrained, a .gguf file or a built-in name"
            )
        return _Source("hf", path.name, path, None)
    check_gguf_magic(path)
    sha = cached_sha256(path, progress=progress)
    return _Source("gguf", f"{path.stem}-{sha[:12]}", path, sha)


def source_name(spec: str | os.PathLike[str]) -> str:
    """The name a model source loads under: a built-in name, `<stem>-<sha12>` for a .gguf
    file, the directory name for an HF directory (so one source has one name whatever the
    spelling of its path or the backend that runs it)."""
    return _resolve_source(spec, None, None).name


def cache_dir_for(name: str, dtype: str | torch.dtype = "bfloat16") -> Path:
    """The safetensors cache directory of model `name` in `dtype`."""
    return models_dir() / f"{name}-{resolve_dtype(dtype)[0]}"


# ----------------------------------------------------------------------------- cache checks


def _read_marker(cache: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((cache / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _cache_is_current(cache: Path, source_sha: str, dtype: str) -> bool:
    """True if `cache` is a complete cache of this very source in this dtype."""
    marker = _read_marker(cache)
    return (
        marker is not None
        and marker.get("format") == CACHE_FORMAT
        and marker.get("source_sha256") == source_sha
        and marker.get("dtype") == dtype
    )


def _rebuild_hint(cache: Path, marker: Mapping[str, Any] | None) -> str:
    """How to rebuild a damaged cache: `prepare --force` on the source the marker names."""
    marker = marker or {}
    name, source = marker.get("name"), marker.get("source")
    arg = name if name in model_catalog(None) else source
    if not isinstance(arg, str) or not arg:
        return f"delete {cache} and rerun `adaspec models prepare`"
    arg = shlex.quote(arg)
    dtype = marker.get("dtype")
    opt = f" --dtype {dtype}" if isinstance(dtype, str) and dtype != "bfloat16" else ""
    return (f"rebuild it with `adaspec models prepare {arg}{opt} --force` "
            f"(or delete {cache} and rerun `adaspec models prepare {arg}{opt}`)")


def verify_cache_dir(cache: Path, *, expected_source_sha: str | None = None,
                     rehash: bool = True, progress: bool | None = None) -> dict[str, Any]:
    """Check a safetensors cache against its marker (sizes; sha256 too if `rehash`).

    Returns the marker; raises ModelStoreError naming the file and the fix.
    """
    marker = _read_marker(cache)
    fix = _rebuild_hint(cache, marker)
    if marker is None or marker.get("format") != CACHE_FORMAT:
        raise ModelStoreError(f"{cache} has no valid {MARKER} (incomplete cache): {fix}")
    if expected_source_sha is not None and marker.get("source_sha256") != expected_source_sha:
        raise ModelStoreError(
            f"{cache} was built from a different GGUF (sha256 {marker.get('source_sha256')}, "
            f"expected {expected_source_sha}): {fix}"
        )
    for fname, info in marker.get("files", {}).items():
        path = cache / fname
        if not path.is_file():
            raise ModelStoreError(f"{path} is missing: {fix}")
        size = path.stat().st_size
        if size != info["size"]:
            raise ModelStoreError(
                f"{path} is truncated or corrupt ({size} bytes, expected {info['size']}): {fix}"
            )
        if rehash:
            got = sha256_file(path, progress=progress)
            if got != info["sha256"]:
                raise ModelStoreError(
                    f"checksum mismatch for {path}: expected sha256 {info['sha256']}, "
                    f"got {got}: {fix}"
                )
    return marker


# ----------------------------------------------------------------------------- GGUF -> cache


def _load_gguf(path: Path, torch_dtype: torch.dtype) -> tuple[Any, Any]:
    """Dequantize a GGUF into a dense transformers model plus its tokenizer (slow)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    fix = f"the file is corrupt or not a supported model; re-create {path}"
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            dtype=torch_dtype,
            # Dense weights: our backend runs plain torch Linear layers; a packed GGUF model
            # would also not give a state dict we could cache.
            quantization_config=GgufConfig(dequantize=True),
            local_files_only=True,
        )
    except Exception as exc:  # transformers raises many types for a bad file
        raise ModelStoreError(f"could not load GGUF {path}: {_one_line(exc)}: {fix}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except Exception as exc:
        raise ModelStoreError(
            f"could not read the tokenizer of GGUF {path}: {_one_line(exc)}: {fix}"
        ) from exc
    return model, tokenizer


def _tied_targets(model: Any) -> set[str]:
    """Parameter names that `from_pretrained` re-ties from the config (e.g. lm_head.weight)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    keys = getattr(model, "all_tied_weights_keys", None) or getattr(
        model, "_tied_weights_keys", None
    )
    if isinstance(keys, Mapping):
        return set(keys)
    return set(keys or ())


def dense_state_dict(model: Any, torch_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A state dict safetensors can write: shared tensors deduplicated, contiguous, in dtype.

    safetensors refuses tensors that share memory. For a tied output head the copy named in
    the model's tied-weight keys is dropped (from_pretrained re-ties it because the config says
    tie_word_embeddings); any other sharing is broken by cloning, which is always correct.
    """
    state = model.state_dict()
    tied = _tied_targets(model)
    groups: dict[int, list[str]] = {}
    for key, tensor in state.items():
        if tensor.device.type == "meta":
            raise ModelStoreError(
                f"weight {key} was never loaded (meta tensor): re-create the model"
            )
        groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(key)
    out: dict[str, torch.Tensor] = {}
    for names in groups.values():
        keep = [n for n in names if n not in tied] or names[:1]
        for i, key in enumerate(keep):
            tensor = state[key].detach()
            if tensor.is_floating_point() and tensor.dtype != torch_dtype:
                tensor = tensor.to(torch_dtype)
            out[key] = tensor.clone() if i > 0 else tensor.contiguous()
    return {k: out[k] for k in state if k in out}


def _clean_config(model: Any, torch_dtype: torch.dtype) -> Any:
    """The model's config as a plain dense checkpoint's config (no GGUF quantization entry)."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch_dtype
    config.architectures = [type(model).__name__]
    return config


def write_cache(model: Any, tokenizer: Any, cache: Path, *, dtype: str,
                marker: Mapping[str, Any]) -> Path:
    """Write model + tokenizer as a loadable directory at `cache`, atomically.

    Everything goes to a temp directory next to it, the marker last; the directory is renamed
    into place only when complete, so a crash never leaves a cache that passes as valid.
    """
    from safetensors.torch import save_file

    torch_dtype = DTYPES[dtype]
    cache.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(cache)  # a killed run's temp directory before counting free space
    state = dense_state_dict(model, torch_dtype)
    need = sum(t.numel() * t.element_size() for t in state.values())
    ensure_free_space(cache.parent, need, f"cache {cache.name}")
    with atomic_dir(cache) as tmp:
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        del state
        _clean_config(model, torch_dtype).save_pretrained(str(tmp))
        # safetensors creates its file 0600; give it the umask-respecting mode of config.json
        os.chmod(tmp / WEIGHTS, (tmp / "config.json").stat().st_mode & 0o777)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        weights = tmp / WEIGHTS
        files = {WEIGHTS: {"size": weights.stat().st_size, "sha256": sha256_file(weights)}}
        full = {**marker, "format": CACHE_FORMAT, "dtype": dtype, "files": files}
        (tmp / MARKER).write_text(json.dumps(full, indent=2) + "\n")
    return cache


# ----------------------------------------------------------------------------- prepare / load


def prepare(name_or_path: str | os.PathLike[str], dtype: str | torch.dtype = "bfloat16", *,
            catalog: Mapping[str, ModelSpec] | None = None, progress: bool | None = None,
            force: bool = False) -> PrepareResult:
    """Make sure a safetensors cache of a built-in model or a .gguf file exists in `dtype`.

    Assembles a built-in model's parts if needed, dequantizes the GGUF once and caches it.
    An HF model directory needs no preparation and is returned as is.
    """
    dtype_name, torch_dtype = resolve_dtype(dtype)
    src = _resolve_source(name_or_path, catalog, progress)
    if src.kind == "hf":
        assert src.path is not None
        return PrepareResult(src.name, dtype_name, src.path, src.path, reused=True)
    assert src.sha256 is not None
    cache = cache_dir_for(src.name, dtype_name)
    if not force and _cache_is_current(cache, src.sha256, dtype_name):
        return PrepareResult(src.name, dtype_name, cache, src.path, reused=True)

    assemble_seconds = 0.0
    gguf = src.path
    if src.kind == "builtin":
        t0 = time.perf_counter()
        gguf = assemble(src.name, catalog=catalog, progress=progress)
        assemble_seconds = time.perf_counter() - t0
    assert gguf is not None
    t0 = time.perf_counter()
    model, tokenizer = _load_gguf(gguf, torch_dtype)
    marker = {"name": src.name, "source": str(gguf), "source_sha256": src.sha256,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_cache(model, tokenizer, cache, dtype=dtype_name, marker=marker)
    del model
    convert_seconds = time.perf_counter() - t0
    return PrepareResult(src.name, dtype_name, cache, gguf, False, assemble_seconds,
                         convert_seconds)


def _load_dir(path: Path, torch_dtype: torch.dtype, fix: str) -> tuple[Any, Any]:
    """Load a dense HF-format directory (ours or a user's) without touching the network."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # Loading dense safetensors takes a second or two: its per-tensor progress bar is noise.
    hf_logging.disable_progress_bar()
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelStoreError(
            f"no tokenizer in {path} (none of {', '.join(_TOKENIZER_FILES)}): save it next to "
            "the weights with tokenizer.save_pretrained(dir)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch_dtype, local_files_only=True
        )
    except Exception as exc:
        raise ModelStoreError(
            f"could not load the model in {path}: {_one_line(exc)}: {fix}"
        ) from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ModelStoreError(
            f"could not load the tokenizer in {path}: {_one_line(exc)}: {fix}"
        ) from exc
    model.eval()
    return model, tokenizer


def load_model(spec: str | os.PathLike[str], dtype: str | torch.dtype = "bfloat16", *,
               catalog: Mapping[str, ModelSpec] | None = None,
               progress: bool | None = None, quant: str = "none") -> LoadedModel:
    """Load a built-in model name, an HF model directory or a .gguf file as a torch CausalLM.

    GGUF sources go through the safetensors cache (prepared on first use), so every load of
    the same source returns the same weights whether or not the cache existed before.
    `quant` (none | int8 | int4 | int8-dyn) then swaps the Linear layers for quantized ones,
    through a cache of its own (store/quant_cache.py).
    """
    if quant != "none":
        from adaspec.store.quant_cache import quantize_loaded

        return quantize_loaded(
            load_model(spec, dtype, catalog=catalog, progress=progress), quant
        )
    dtype_name, torch_dtype = resolve_dtype(dtype)
    src = _resolve_source(spec, catalog, progress)
    if src.kind == "hf":
        assert src.path is not None
        t0 = time.perf_counter()
        model, tokenizer = _load_dir(
            src.path, torch_dtype, "check it holds config.json and the weights"
        )
        return LoadedModel(model, tokenizer, src.name, src.path, dtype_name, None,
                           time.perf_counter() - t0)
    prepared = prepare(spec, dtype_name, catalog=catalog, progress=progress)
    cache = prepared.cache_dir
    marker = verify_cache_dir(cache, expected_source_sha=src.sha256, rehash=False)
    fix = f"delete {cache} and rerun `adaspec models prepare {src.name}`"
    t0 = time.perf_counter()
    model, tokenizer = _load_dir(cache, torch_dtype, fix)
    seconds = time.perf_counter() - t0
    source = prepared.source or Path(marker.get("source", str(cache)))
    return LoadedModel(model, tokenizer, src.name, source, dtype_name, cache, seconds, prepared)


def load_tokenizer(spec: str | os.PathLike[str], dtype: str | torch.dtype = "bfloat16", *,
                   catalog: Mapping[str, ModelSpec] | None = None) -> Any:
    """Only the tokenizer of a model (for a backend that runs the weights itself, such as
    llama.cpp on the GGUF): from the verified cache, prepared first if needed."""
    from transformers import AutoTokenizer

    src = _resolve_source(spec, catalog, None)
    if src.kind == "hf":
        assert src.path is not None
        path = src.path
    else:
        path = prepare(spec, dtype, catalog=catalog).cache_dir
    fix = f"check {path} holds the tokenizer files, or rerun `adaspec models prepare`"
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ModelStoreError(f"could not load the tokenizer in {path}: {_one_line(exc)}: "
                              f"{fix}") from exc


def tokenizer_dir(spec: str | os.PathLike[str], dtype: str | torch.dtype = "bfloat16") -> Path:
    """The folder `load_tokenizer` reads (prepared first if needed)."""
    src = _resolve_source(spec, None, None)
    if src.kind == "hf":
        assert src.path is not None
        return src.path
    return prepare(spec, dtype).cache_dir


# What decides how text becomes token ids (the chat template only shapes prompts, which the
# target's tokenizer builds).
VOCAB_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "vocab.json", "merges.txt")


def same_vocabulary_files(a: Path, b: Path) -> bool:
    """True when two model folders carry byte-identical tokenizer files: the pair check
    would pass, so the second tokenizer (about a second to load) need not be loaded."""
    found = False
    for name in VOCAB_FILES:
        fa, fb = a / name, b / name
        if fa.is_file() != fb.is_file():
            return False
        if fa.is_file():
            found = True
            if fa.stat().st_size != fb.stat().st_size or fa.read_bytes() != fb.read_bytes():
                return False
    return found


# ----------------------------------------------------------------------------- tokenizers


def _special_ids(tok: Any) -> dict[str, Any]:
    attrs = ("bos_token", "eos_token", "unk_token")
    return {attr: getattr(tok, f"{attr}_id", None) for attr in attrs}


def _suggest_draft(target_name: str) -> str:
    if target_name == TARGET_DEFAULT or "qwen" in target_name.lower():
        return DRAFT_DEFAULT
    others = [n for n, s in CATALOG.items() if s.role == "draft"]
    return ", ".join(others) if others else DRAFT_DEFAULT


def check_tokenizer_pair(target_tok: Any, draft_tok: Any, target_name: str,
                         draft_name: str) -> None:
    """Raise unless draft and target tokenize identically (same vocab and special tokens).

    Speculative decoding compares token ids across the two models; with different
    vocabularies the draft's proposals mean nothing to the target.
    """
    fix = (f"pick a draft that shares the target's tokenizer, e.g. {_suggest_draft(target_name)}"
           f" for {target_name}")
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        if len(tv) != len(dv):
            detail = f"{len(tv)} vs {len(dv)} tokens"
        else:
            inv_t = {i: t for t, i in tv.items()}
            inv_d = {i: t for t, i in dv.items()}
            diff = next(i for i in sorted(set(inv_t) | set(inv_d)) if inv_t.get(i) != inv_d.get(i))
            detail = (
                f"same size {len(tv)}, but id {diff} is {inv_t.get(diff)!r} "
                f"vs {inv_d.get(diff)!r}"
            )
        raise ModelStoreError(
            f"draft {draft_name} does not share the tokenizer of target {target_name} "
            f"({detail}): {fix}"
        )
    ts, ds = _special_ids(target_tok), _special_ids(draft_tok)
    if ts != ds:
        diff = {k: (ts[k], ds[k]) for k in ts if ts[k] != ds[k]}
        raise ModelStoreError(
            f"draft {draft_name} and target {target_name} have different special tokens "
            f"(target vs draft ids: {diff}): {fix}"
        )


def check_model_pair(target: LoadedModel, draft: LoadedModel) -> None:
    """Tokenizers match and the draft's output head covers every id the target can emit."""
    check_tokenizer_pair(target.tokenizer, draft.tokenizer, target.name, draft.name)
    if draft.vocab_size < len(target.tokenizer):
        raise ModelStoreError(
            f"draft {draft.name} scores {draft.vocab_size} ids but the tokenizer has "
            f"{len(target.tokenizer)}: {_suggest_draft(target.name)} pairs with {target.name}"
        )

