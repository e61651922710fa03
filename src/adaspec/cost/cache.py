"""Cost profiles cached per configuration under `$ADASPEC_HOME/profiles/`.

The key names everything that changes the costs: the CPU model, the threads, each model's
runtime (torch, llama.cpp, ik_llama.cpp, in a child process or not) and its weights (the
model's name, which for a GGUF file carries its checksum, and the bytes one forward reads,
which differ between quantizations). A configuration is measured the first time it runs and
read back afterwards.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from adaspec.backends.base import ModelBackend
from adaspec.backends.weights import llama_threads
from adaspec.cost.profile import CostProfile

if TYPE_CHECKING:
    from adaspec.cost.measure import LoopOverhead
from adaspec.errors import InputError
from adaspec.store.native_build import cpu_model


def describe_backend(backend: ModelBackend) -> dict:
    """What a cost curve depends on: the model, the runtime and, for a library built here,
    the source changes it carries and when it was built (a new patch, or a rebuild, makes
    the stored curves stale)."""
    out = {
        "name": backend.name,
        "kind": getattr(backend, "kind", "torch"),
        "bytes_per_forward": int(backend.bytes_per_forward),
    }
    patches = getattr(backend, "patches", ())
    if patches:
        out["patches"] = sorted(patches)
    built = getattr(backend, "built_at", None)
    if built:
        out["built_at"] = str(built)
    return out


def profile_key(target: ModelBackend, draft: ModelBackend | None) -> dict:
    key = {
        "cpu": cpu_model(),
        "threads": llama_threads(),
        "target": describe_backend(target),
        "draft": describe_backend(draft) if draft is not None else None,
    }
    device = getattr(target, "device", "cpu")
    if device != "cpu":  # a CPU profile's key stays as before the device axis
        from adaspec.backends.device import device_name

        key["device"] = device_name(device)
    return key


def profiles_dir() -> Path:
    from adaspec.store.assembly import adaspec_home

    return adaspec_home() / "profiles"


def profile_path(key: dict) -> Path:
    """A readable, unique file name: the runtime and model names, then a hash of the key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    parts = [key["target"]["kind"], key["target"]["name"]]
    if key.get("draft"):
        parts += [key["draft"]["kind"], key["draft"]["name"]]
    slug = re.sub(r"[^A-Za-z0-9_.+-]+", "_", "-".join(parts))
    return profiles_dir() / f"{slug}-{digest}.json"


def cached_profile(key: dict) -> CostProfile | None:
    """The stored profile of this configuration, or None (missing or unreadable)."""
    path = profile_path(key)
    if not path.is_file():
        return None
    try:
        profile = CostProfile.load(path)
    except InputError:
        return None
    return profile if profile.key == key else None


def profile_for(
    target: ModelBackend,
    draft: ModelBackend | None = None,
    tokenizer=None,
    remeasure: bool = False,
    quiet: bool = False,
    *,
    loop_overhead: LoopOverhead,
) -> CostProfile:
    """This configuration's profile: from the cache, or measured now (and cached);
    `loop_overhead` as `cost.measure.measure_profile` takes it."""
    from adaspec.cost import other_load
    from adaspec.cost.measure import measure_profile

    key = profile_key(target, draft)
    if not remeasure:
        found = cached_profile(key)
        if found is not None and not other_load.measure_again(found.others_share):
            return found
    if not quiet:
        print(
            f"adaspec: measuring what speculation costs on this machine ({key['cpu']}, "
            f"{key['threads']} threads; once per configuration, cached in {profiles_dir()})",
            file=sys.stderr,
        )
    profile = other_load.measured(  # its note said even when quiet: it decides every price
        lambda: measure_profile(target, draft, tokenizer, key=key, loop_overhead=loop_overhead),
        "the cost profile", lambda text: print(f"adaspec: {text}", file=sys.stderr))
    profile.save(profile_path(key))
    return profile
