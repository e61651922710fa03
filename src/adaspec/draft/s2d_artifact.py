"""A sorted draft on disk: its trained layers, the token set of its head, and a manifest.

Folder layout (under `$ADASPEC_HOME/s2d/NAME/` by default; never in git):
  manifest.json       format, shapes and exits, the source model (name, file sha256), what
                      was frozen, training and data provenance, thresholds per target
  weights.safetensors the decoder layers and final norm (trained), the kept token ids

The embeddings and the output head are frozen in training (they are the largest tensors and
shared with the source model), so they are read from the source model's own weights when the
artifact loads; the manifest's sha256 makes sure they are the same weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from adaspec.draft.sorted_model import SortedConfig, SortedDraftLM
from adaspec.errors import InputError
from adaspec.store.atomic import atomic_path, write_json

FORMAT = "adaspec-s2d"
VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
FROZEN = ("embed_tokens", "lm_head")  # read from the source model, never trained


def s2d_home() -> Path:
    from adaspec.store.assembly import adaspec_home

    return adaspec_home() / "s2d"


def resolve(path_or_name: str | os.PathLike[str]) -> Path:
    """An artifact folder: a path, or a name under `$ADASPEC_HOME/s2d/`."""
    p = Path(path_or_name).expanduser()
    if (p / MANIFEST).is_file():
        return p
    named = s2d_home() / str(path_or_name)
    if (named / MANIFEST).is_file():
        return named
    raise InputError(
        f"no S2D artifact at {path_or_name!r} (looked for {p / MANIFEST} and "
        f"{named / MANIFEST}): build one with `adaspec s2d train`"
    )


def source_files(source: str) -> tuple[Path, str, Any]:
    """The source model's safetensors file, its sha256 and its transformers config."""
    from transformers import AutoConfig

    from adaspec.store.assembly import cached_sha256
    from adaspec.store.loading import prepare

    prepared = prepare(source, "bfloat16", progress=False)
    folder = Path(prepared.cache_dir)
    files = sorted(folder.glob("*.safetensors"))
    if len(files) != 1:
        raise InputError(f"expected one .safetensors file in {folder}, found {len(files)}")
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    return files[0], cached_sha256(files[0], progress=False), config


def _read(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        for name in names:
            if name not in keys:
                raise InputError(f"{path} has no tensor {name!r}: not a Qwen2-style model")
            out[name] = f.get_tensor(name)
    return out


def _frozen_state(weights: Path, token_ids: torch.Tensor, tied: bool
                  ) -> dict[str, torch.Tensor]:
    head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    t = _read(weights, sorted({"model.embed_tokens.weight", head_name}))
    return {"embed_tokens.weight": t["model.embed_tokens.weight"],
            "lm_head.weight": t[head_name].index_select(0, token_ids)}


def extract(source: str, exits: tuple[int, ...], token_ids: torch.Tensor | None = None,
            dtype: torch.dtype = torch.float32) -> tuple[SortedDraftLM, dict]:
    """A sorted draft from the first `exits[-1]` layers of `source` (untrained: each exit is
    the source's truncated stack under its own final norm and head). Returns the model and
    the manifest's `source` record."""
    weights, sha, config = source_files(source)
    n_source = int(config.num_hidden_layers)
    if exits[-1] > n_source:
        raise InputError(f"{source} has {n_source} layers; the exits {list(exits)} ask for "
                         f"{exits[-1]}")
    cfg = SortedConfig.from_hf(config, exits)
    model = SortedDraftLM(cfg, token_ids)
    names = [f"model.layers.{i}.{k}" for i in range(cfg.num_layers)
             for k in _layer_keys(model)] + ["model.norm.weight"]
    state = {k.removeprefix("model."): v for k, v in _read(weights, names).items()}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state.update(_frozen_state(weights, model.token_ids, tied))
    state["token_ids"] = model.token_ids
    model.load_state_dict(state, strict=True)
    model.to(dtype)
    record = {"name": source, "weights": weights.name, "sha256": sha, "layers": n_source,
              "tied_head": tied}
    return model, record


def _layer_keys(model: SortedDraftLM) -> list[str]:
    return [k.split(".", 2)[2] for k in model.state_dict() if k.startswith("layers.0.")]


def trained_state(model: SortedDraftLM) -> dict[str, torch.Tensor]:
    """What an artifact stores: everything but the frozen tensors."""
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()
            if not k.startswith(FROZEN)}


def save(model: SortedDraftLM, folder: str | os.PathLike[str], manifest: dict) -> Path:
    """Write the weights, then the manifest (the manifest last: a folder with a manifest is
    complete). Both are written atomically."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / WEIGHTS) as tmp:
        save_file(trained_state(model), str(tmp))
    full = {"format": FORMAT, "version": VERSION, **manifest,
            "config": model.config.to_dict(), "frozen": list(FROZEN),
            "kept_tokens": int(model.token_ids.numel())}
    write_json(out / MANIFEST, full)
    return out


def read_manifest(folder: str | os.PathLike[str]) -> dict:
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read the S2D manifest {path}: {exc}") from exc
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise InputError(f"{path} is not an S2D artifact of version {VERSION}")
    return manifest


def update_manifest(folder: str | os.PathLike[str], **changes: Any) -> dict:
    manifest = read_manifest(folder)
    manifest.update(changes)
    write_json(Path(folder) / MANIFEST, manifest)
    return manifest


def load(path_or_name: str | os.PathLike[str], dtype: torch.dtype = torch.float32
         ) -> tuple[SortedDraftLM, dict]:
    """The sorted draft of an artifact, frozen tensors read from its source model."""
    from safetensors.torch import load_file

    folder = resolve(path_or_name)
    manifest = read_manifest(folder)
    cfg = SortedConfig.from_dict(manifest["config"])
    state = load_file(str(folder / WEIGHTS))
    model = SortedDraftLM(cfg, state["token_ids"])
    src = manifest["source"]
    weights, sha, _ = source_files(src["name"])
    if sha != src["sha256"]:
        raise InputError(
            f"the S2D artifact {folder} was built on {src['name']} with sha256 "
            f"{src['sha256'][:12]}…, but that model's weights are now {sha[:12]}…"
        )
    state.update(_frozen_state(weights, model.token_ids, bool(src.get("tied_head"))))
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval(), manifest


def load_for_drafting(path_or_name: str | os.PathLike[str], weights: str = "bfloat16"
                      ) -> tuple[SortedDraftLM, dict]:
    """The artifact ready to draft: `weights` is a dtype (bfloat16, float32) or a weight-only
    quantization of the Linear layers over bf16 (int8, int4; store/quant.py)."""
    from adaspec.store.quant import quantize_model

    if weights in ("int8", "int4"):
        model, manifest = load(path_or_name, torch.bfloat16)
        quantize_model(model, weights)
        return model.eval(), manifest
    if weights not in ("bfloat16", "float32"):
        raise InputError(f"unknown sorted-draft weights {weights!r}")
    return load(path_or_name, getattr(torch, weights))


def tuned_for(manifest: dict, target: str) -> dict | None:
    """What `adaspec s2d tune` stored for this target (thresholds, k, predictions), if any."""
    return (manifest.get("thresholds") or {}).get(target)
