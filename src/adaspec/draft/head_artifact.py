"""A trained draft head on disk, and the target's parts it reads.

One file (`torch.save`, loaded with `weights_only=True`): the format tag, the head's config
and state, the kept token ids of its output head and its provenance (the commands, the
training data's checksum, the date and the machine). The target's token embeddings and the
output rows of the kept tokens are not stored: they are the target's own, read at load from
the loaded torch model or, for a GGUF runtime, from the target's bf16 copy that
`adaspec models prepare` made (`model.safetensors`, memory-mapped, only those rows read).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adaspec.draft.head_model import DraftHead, HeadConfig, TokenHead
from adaspec.errors import InputError
from adaspec.store.atomic import atomic_open

FORMAT = "adaspec-draft-head-1"
EMBED = "model.embed_tokens.weight"
OUTPUT = "lm_head.weight"


@dataclass
class HeadArtifact:
    config: HeadConfig
    state: dict[str, torch.Tensor]
    token_ids: torch.Tensor  # [N] sorted kept ids
    provenance: dict[str, Any]

    def head(self, dtype: torch.dtype = torch.float32) -> DraftHead:
        head = DraftHead(self.config)
        head.load_state_dict(self.state)
        return head.to(dtype).eval()

    @property
    def parameters(self) -> int:
        """Parameters a drafted token runs through: the head's own and the rows of the
        target's output head it keeps (the token embedding is a lookup)."""
        own = sum(t.numel() for t in self.state.values())
        return int(own + len(self.token_ids) * self.config.hidden)


def save(path: Path, head: DraftHead, token_ids: torch.Tensor, provenance: dict) -> None:
    """Write atomically (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as f:
        torch.save({"format": FORMAT, "config": head.cfg.to_json(),
                    # bf16 on disk (what the drafter runs in): half the bytes of fp32
                    "state": {k: v.detach().cpu().to(torch.bfloat16)
                              if v.is_floating_point() else v.detach().cpu()
                              for k, v in head.state_dict().items()},
                    "token_ids": token_ids.cpu(), "provenance": provenance}, f)


def load(path: str | Path) -> HeadArtifact:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"draft head not found: {p}")
    try:
        raw = torch.load(p, weights_only=True, map_location="cpu")
    except Exception as exc:  # a torn or foreign file: one line, the path named
        raise InputError(f"{p} is not a readable draft head ({type(exc).__name__})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise InputError(f"{p} is not a draft head of format {FORMAT}")
    return HeadArtifact(HeadConfig(**raw["config"]), raw["state"], raw["token_ids"].long(),
                        dict(raw.get("provenance") or {}))


def target_parts(model: Any | None, weights_file: Path | None, token_ids: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, TokenHead]:
    """The target's token embeddings [V, H] and its output head restricted to `token_ids`
    (in `dtype`): from a loaded transformers model, else from its safetensors file."""
    if model is not None:
        embed = model.get_input_embeddings().weight.detach()
        out = model.get_output_embeddings().weight.detach()
        vocab = int(out.shape[0])
        rows = out[token_ids]
    elif weights_file is not None:
        from safetensors import safe_open

        with safe_open(str(weights_file), framework="pt") as f:
            embed = f.get_tensor(EMBED)
            out_name = _output_name(f)
            out_slice = f.get_slice(out_name)
            vocab = int(out_slice.get_shape()[0])
            rows = f.get_tensor(out_name)[token_ids]
    else:
        raise InputError("a draft head needs the target's weights (a torch model, or the "
                         "bf16 copy `adaspec models prepare` makes)")
    # the embeddings stay in the file's dtype (a row is read per token)
    return embed, TokenHead(rows.to(dtype).clone(), token_ids, vocab)


def _output_name(f: Any) -> str:
    """The output matrix's name in an open safetensors file (the embeddings where tied)."""
    return OUTPUT if OUTPUT in set(f.keys()) else EMBED


def target_rows(model: Any | None, weights_file: Path | None
                ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The target's output rows [n, H] of token ids [n], read on demand (the full output
    matrix is 0.5 GB in bf16 for a 150k vocabulary: a grown kept set reads its few rows)."""
    if model is not None:
        out = model.get_output_embeddings().weight
        return lambda ids: out.detach()[ids].float()
    if weights_file is None:
        raise InputError("the target's output rows need a torch model or its bf16 copy")

    def read(ids: torch.Tensor) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(weights_file), framework="pt") as f:
            table = f.get_slice(_output_name(f))
            return torch.stack([table[int(i) : int(i) + 1][0] for i in ids]).float()

    return read


def target_config(folder: Path) -> Any:
    """The target's transformers config (its `config.json` in the bf16 copy's folder)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))


def end_tokens(folder: Path) -> list[int]:
    """The target's end-of-turn ids (its `generation_config.json`): always kept tokens."""
    import json

    try:
        eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        eos = None
    if isinstance(eos, int):
        return [eos]
    return [int(e) for e in eos or []]


def builtin_for(target: str) -> Path | None:
    """The head shipped for model `target` (a catalog name), where one ships."""
    from adaspec.draft.builtin import head_file

    path = head_file(target)
    return path if path.is_file() else None


def load_for_target(path: Path, target: Any, dtype: torch.dtype = torch.float32
                    ) -> tuple[DraftHead, TokenHead, torch.Tensor]:
    """The head, its restricted output head and the target's embeddings, ready to draft:
    the target's parts from its torch model where it runs in torch, else from the bf16 copy
    `adaspec models prepare` made (only the kept output rows are read). fp32 by default:
    at batch 1 torch's fp32 products read weights faster than its bf16 ones on the CPUs
    measured (experiments/head_cost.py: a step 4-6 ms either way on 2 vCPUs, fp32 ahead)."""
    art = load(path)
    model, weights = _target_source(target)
    embed, tokens = target_parts(model, weights, art.token_ids, dtype)
    if art.config.hidden != int(embed.shape[1]):
        raise InputError(f"{path} is a head for hidden size {art.config.hidden}, the target "
                         f"has {int(embed.shape[1])}")
    return art.head(dtype), tokens.eval(), embed


def _target_source(target: Any) -> tuple[Any | None, Path | None]:
    """Where a head reads the target's embeddings and output rows: its torch model where it
    runs in torch, else the bf16 copy `adaspec models prepare` made."""
    from adaspec.store.loading import cache_dir_for

    model = getattr(target, "model", None)
    if model is not None and hasattr(model, "get_input_embeddings"):
        return model, None
    weights = cache_dir_for(target.name) / "model.safetensors"
    if not weights.is_file():
        raise InputError(f"the draft head reads the target's embeddings from {weights}, "
                         f"which is missing: adaspec models prepare")
    return None, weights


def rows_for_target(target: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """`target_rows` from where `load_for_target` reads `target`'s parts."""
    return target_rows(*_target_source(target))


_FINGERPRINTS: dict[tuple[str, int, int], str] = {}


def fingerprint(path: str | Path) -> str:
    """The name a trained controller (DISCO) pairs with: `head:` and the first 12 hex
    digits of the file's sha256, so a classifier of one head is never read with another's
    distributions (hashed once per file version in a process)."""
    import hashlib

    p = Path(path).resolve()
    stat = p.stat()
    key = (str(p), stat.st_mtime_ns, stat.st_size)
    if key not in _FINGERPRINTS:
        _FINGERPRINTS[key] = "head:" + hashlib.sha256(p.read_bytes()).hexdigest()[:12]
    return _FINGERPRINTS[key]
