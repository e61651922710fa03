"""The N most frequent target tokens, stored with a draft: the rows its restricted head keeps.

A draft whose output head scores only N tokens costs less per step (the 151,936 x 896 head
is a large share of the 0.5B draft's weights), and speculative sampling stays exact because
the draft's q is simply zero outside the set. Which N tokens: counted on real target outputs
(greedy or sampled `ar` rows, and `llamacpp` rows, of bench results files, counted by
`lab/bench/token_counts.py`), so the set is what the target actually emits. Every special
token (EOS included) is always in the set; slots the counts cannot fill go to the lowest
unseen ids (a byte-level BPE assigns ids in merge order, so low ids are the short, common
pieces).

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

from adaspec.errors import InputError, ModelStoreError
from adaspec.store.assembly import models_dir
from adaspec.store.atomic import write_json

FORMAT = 1


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
