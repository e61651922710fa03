"""Saved adapters (the trained tensors of a draft's last layers), one folder per domain under
`$ADASPEC_HOME/osd/<draft>-last<L>/<domain>/`.

Each save writes `adapter-<step>.safetensors` (write, then rename), then `adapter.json`
naming that file and its sha256 (write, then rename), then deletes older tensor files. A
crash at any point leaves `adapter.json` naming a complete file; a load re-hashes the file
and refuses one that does not match, so a half-written draft is never served.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from adaspec.errors import InputError
from adaspec.store.assembly import sha256_file
from adaspec.store.atomic import atomic_path, write_json

MANIFEST = "adapter.json"
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def adapters_root(draft: str, layers: int) -> Path:
    from adaspec.store.assembly import adaspec_home

    return adaspec_home() / "osd" / f"{safe_name(Path(draft).name)}-last{layers}"


def safe_name(text: str) -> str:
    """A domain or model name as a folder name."""
    name = _SAFE.sub("_", text).strip("._") or "default"
    return name[:80]


@dataclass
class Adapter:
    domain: str
    step: int  # optimizer steps behind these tensors
    updates: int  # accepted updates
    state: dict[str, torch.Tensor]
    meta: dict


def save_adapter(root: Path, adapter: Adapter) -> Path:
    from safetensors.torch import save_file

    folder = root / safe_name(adapter.domain)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"adapter-{adapter.step:08d}.safetensors"
    with atomic_path(folder / name) as tmp:
        save_file({k: v.contiguous() for k, v in adapter.state.items()}, str(tmp))
    manifest = {**adapter.meta, "domain": adapter.domain, "step": adapter.step,
                "updates": adapter.updates, "file": name,
                "sha256": sha256_file(folder / name, progress=False)}
    write_json(folder / MANIFEST, manifest)
    for old in folder.glob("adapter-*.safetensors"):
        if old.name != name:
            old.unlink(missing_ok=True)
    return folder / MANIFEST


def load_adapter(folder: Path) -> Adapter:
    """The adapter a folder's manifest names, checked against its sha256."""
    from safetensors.torch import load_file

    try:
        meta = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        path = folder / meta["file"]
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"{folder / MANIFEST} is unreadable ({exc}): delete {folder} to "
                         "start this domain's draft afresh") from None
    if not path.is_file() or sha256_file(path, progress=False) != meta.get("sha256"):
        raise InputError(f"{path} does not match the sha256 in {folder / MANIFEST} (a torn "
                         f"or changed file): delete {folder} to start this domain afresh")
    return Adapter(meta["domain"], int(meta["step"]), int(meta.get("updates", 0)),
                   load_file(str(path)), meta)


def load_all(root: Path) -> dict[str, Adapter]:
    """Every domain's saved adapter under `root` (none if the folder does not exist)."""
    found: dict[str, Adapter] = {}
    if not root.is_dir():
        return found
    for folder in sorted(p for p in root.iterdir() if (p / MANIFEST).is_file()):
        adapter = load_adapter(folder)
        found[adapter.domain] = adapter
    return found
