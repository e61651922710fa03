"""A stream of served requests with domain shifts: the target's greedy outputs collected by
`adaspec s2d data` (prompts never used by the bench's tests), arranged in blocks by suite."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from adaspec.errors import InputError
from adaspec.lab.s2d.data import read_meta, read_rows

DEFAULT_BLOCKS = "humaneval,wmt,sharegpt,spec-bench"


@dataclass
class StreamRequest:
    index: int
    prompt_id: str
    suite: str  # the domain
    prompt_ids: list[int]
    output: list[int]  # the target's greedy output (what serving it returns)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output


def build_stream(data: str | Path, blocks: str = DEFAULT_BLOCKS, per_block: int = 0,
                 repeat: int = 1) -> tuple[list[StreamRequest], dict]:
    """Requests in blocks of one suite each, in the order `blocks` names them (`repeat`
    times over); per_block > 0 keeps that many of each suite. Returns (stream, the data's
    settings)."""
    meta = read_meta(data)
    if not meta.get("complete"):
        raise InputError(f"{data} is an unfinished collection: rerun `adaspec s2d data`")
    rows = read_rows(data)
    names = [b.strip() for b in blocks.split(",") if b.strip()]
    by_suite: dict[str, list] = {}
    for r in rows:
        by_suite.setdefault(r.suite, []).append(r)
    unknown = [n for n in names if n not in by_suite]
    if unknown:
        raise InputError(f"no rows of {unknown} in {data} (it has {sorted(by_suite)})")
    stream: list[StreamRequest] = []
    for _ in range(max(1, repeat)):
        for name in names:
            chosen = sorted(by_suite[name], key=lambda r: r.prompt_id)
            if per_block > 0:
                chosen = chosen[:per_block]
            for r in chosen:
                if r.output:
                    stream.append(StreamRequest(len(stream), r.prompt_id, name,
                                                list(r.prompt_ids), list(r.output)))
    return stream, meta


def blocks_of(stream: list[StreamRequest]) -> list[tuple[str, int, int]]:
    """(suite, first index, end index) of each block."""
    out: list[tuple[str, int, int]] = []
    for r in stream:
        if out and out[-1][0] == r.suite and out[-1][2] == r.index:
            out[-1] = (r.suite, out[-1][1], r.index + 1)
        else:
            out.append((r.suite, r.index, r.index + 1))
    return out
