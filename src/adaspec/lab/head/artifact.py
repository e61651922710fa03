"""A trained draft head on disk, and the target's parts it reads.

One file (`torch.save`, loaded with `weights_only=True`): the format tag, the head's config
and state, the kept token ids of its output head and its provenance (the commands, the
training data's checksum, the date and the machine). The target's token embeddings and the
output rows of the kept tokens are not stored: they are the target's own, read at load from
the loaded torch model or, for a GGUF runtime, from the target's bf16 copy that
`adaspec models prepare` made (`model.safetensors`, memory-mapped, only those rows read).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adaspec.errors import InputError
from adaspec.lab.head.model import DraftHead, HeadConfig, TokenHead

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


def save(path: Path, head: DraftHead, token_ids: torch.Tensor, provenance: dict) -> None:
    """Write atomically (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save({"format": FORMAT, "config": head.cfg.to_json(),
                "state": {k: v.detach().cpu() for k, v in head.state_dict().items()},
                "token_ids": token_ids.cpu(), "provenance": provenance}, tmp)
    tmp.replace(path)


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
            names = set(f.keys())
            embed = f.get_tensor(EMBED)
            out_name = OUTPUT if OUTPUT in names else EMBED  # tied embeddings
            out_slice = f.get_slice(out_name)
            vocab = int(out_slice.get_shape()[0])
            rows = f.get_tensor(out_name)[token_ids]
    else:
        raise InputError("a draft head needs the target's weights (a torch model, or the "
                         "bf16 copy `adaspec models prepare` makes)")
    # the embeddings stay in the file's dtype (a row is read per token)
    return embed, TokenHead(rows.to(dtype).clone(), token_ids, vocab)
