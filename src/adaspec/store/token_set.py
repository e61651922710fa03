"""The N most frequent target tokens, stored with a draft: the rows its restricted head keeps.

A draft whose output head scores only N tokens costs less per step (the 151,936 x 896 head
is a large share of the 0.5B draft's weights), and speculative sampling stays exact because
the draft's q is simply zero outside the set. Which N tokens: counted on real target outputs
(greedy or sampled `ar` rows, and `llamacpp` rows, of bench results files), so the set is
what the target actually emits. Every special token (EOS included) is always in the set;
slots the counts cannot fill go to the lowest unseen ids (a byte-level BPE assigns ids in
merge order, so low ids are the short, common pieces).

Stored as JSON under `$ADASPEC_HOME/models/<draft>.vocab/top<N>.json` with its provenance
and a sha256 of the id list, checked on every load.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaspec.errors import InputError, ModelStoreError
from adaspec.store.assembly import models_dir, sha256_file
from adaspec.store.atomic import write_json

FORMAT = 1
COUNTED_METHODS = ("ar", "llamacpp")  # plain decoding of the target: its real outputs


@dataclass(frozen=True)
class TokenSet:
    """Sorted token ids a restricted draft head keeps, with where they came from."""

    draft: str
    token_ids: tuple[int, ...]
    provenance: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.token_ids)


def token_set_path(draft: str, size: int) -> Path:
    """Where the top-`size` set of draft `draft` lives (next to its weight caches)."""
    return models_dir() / f"{draft}.vocab" / f"top{size}.json"


def ids_sha256(ids: Iterable[int]) -> str:
    return hashlib.sha256(",".join(str(int(i)) for i in ids).encode()).hexdigest()


# ----------------------------------------------------------------------------- counting


def _settings(results: Path) -> dict:
    run = results.parent / "run.json"
    try:
        return json.loads(run.read_text()).get("settings", {})
    except (OSError, ValueError):
        return {}


def count_target_outputs(
    results: list[Path], target: str | None, exclude_prompts: Iterable[str] = ()
) -> tuple[Counter, dict]:
    """Token counts over the target's outputs in bench `results.jsonl` files.

    Rows of plain decoding (COUNTED_METHODS) only. A prompt's output seen in several files
    counts once: an output that is a prefix of another kept output of the same prompt is a
    shorter run of the same decoding. Files whose run.json names another target are skipped
    (other token ids). Returns (counts, provenance)."""
    excluded = set(exclude_prompts)
    outputs: dict[str, list[tuple[int, ...]]] = {}
    sources: list[dict[str, Any]] = []
    for path in results:
        if not path.is_file():
            raise InputError(f"results file not found: {path}")
        settings = _settings(path)
        if target and settings.get("target") not in (None, target):
            sources.append({"path": str(path), "skipped": f"target {settings['target']}"})
            continue
        used = 0
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut off by a killed run
            if not isinstance(row, dict) or row.get("method") not in COUNTED_METHODS:
                continue
            pid = str(row.get("prompt_id"))
            if pid in excluded or not row.get("token_ids"):
                continue
            used += 1
            out = tuple(int(t) for t in row["token_ids"])
            kept = outputs.setdefault(pid, [])
            if any(k[: len(out)] == out for k in kept):
                continue
            kept[:] = [k for k in kept if out[: len(k)] != k] + [out]
        sources.append(
            {
                "path": str(path),
                "sha256": sha256_file(path),
                "rows": used,
                "temperature": settings.get("temperature"),
            }
        )
    counts: Counter = Counter()
    for outs in outputs.values():
        for out in outs:
            counts.update(out)
    provenance = {
        "methods": list(COUNTED_METHODS),
        "sources": sources,
        "excluded_prompts": sorted(excluded),
        "prompts": len(outputs),
        "outputs": sum(len(o) for o in outputs.values()),
        "tokens": sum(counts.values()),
        "distinct": len(counts),
    }
    return counts, provenance


def top_tokens(
    counts: Counter, size: int, vocab_size: int, special_ids: Iterable[int]
) -> list[int]:
    """Specials, then by count (ties: lower id first), then the lowest unseen ids; sorted."""
    specials = sorted({int(i) for i in special_ids if 0 <= int(i) < vocab_size})
    if size <= len(specials):
        raise InputError(
            f"--top {size} leaves no room beside the {len(specials)} special tokens: use more"
        )
    if size > vocab_size:
        raise InputError(f"--top {size} exceeds the draft's vocabulary of {vocab_size}")
    chosen = dict.fromkeys(specials)
    ranked = sorted((t for t in counts if 0 <= t < vocab_size), key=lambda t: (-counts[t], t))
    for t in ranked:
        if len(chosen) >= size:
            break
        chosen.setdefault(t)
    t = 0
    while len(chosen) < size:
        chosen.setdefault(t)
        t += 1
    return sorted(chosen)


# ----------------------------------------------------------------------------- storage


def save_token_set(token_set: TokenSet) -> Path:
    """Write atomically; the file carries the provenance and the ids' sha256."""
    path = token_set_path(token_set.draft, token_set.size)
    ids = list(token_set.token_ids)
    body = {
        "format": FORMAT,
        "draft": token_set.draft,
        "size": len(ids),
        "sha256": ids_sha256(ids),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "provenance": token_set.provenance,
        "token_ids": ids,
    }
    return write_json(path, body, indent=1)


def load_token_set(draft: str, size: int, vocab_size: int | None = None) -> TokenSet:
    """The stored top-`size` set of `draft`, checked (format, draft, checksum, id range)."""
    path = token_set_path(draft, size)
    make = f"`adaspec models restrict-vocab --draft {draft} --top {size}`"
    if not path.is_file():
        raise ModelStoreError(f"no top-{size} token set for draft {draft} ({path}): run {make}")
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        ids = tuple(int(t) for t in body["token_ids"])
        ok = body.get("format") == FORMAT and body.get("sha256") == ids_sha256(ids)
    except (OSError, ValueError, KeyError, TypeError):
        ok, body, ids = False, {}, ()
    if not ok:
        raise ModelStoreError(f"{path} is corrupt (checksum or format): delete it and run {make}")
    if body.get("draft") != draft or len(ids) != size or len(set(ids)) != size:
        raise ModelStoreError(f"{path} does not hold {size} ids for draft {draft}: rerun {make}")
    if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ModelStoreError(
            f"{path} has ids outside the draft's vocabulary of {vocab_size}: rerun {make}"
        )
    return TokenSet(draft, tuple(sorted(ids)), body.get("provenance", {}))
