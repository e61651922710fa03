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


def parse_blocks(blocks: str) -> list[tuple[str, int]]:
    """`suite[:N],...` -> [(suite, N)] (N = 0 when not given)."""
    out: list[tuple[str, int]] = []
    for part in filter(None, (b.strip() for b in blocks.split(","))):
        name, _, count = part.partition(":")
        try:
            n = int(count) if count else 0
        except ValueError:
            raise InputError(f"block {part!r}: the count after ':' must be an integer") from None
        if n < 0:
            raise InputError(f"block {part!r}: the count must be >= 0")
        out.append((name.strip(), n))
    if not out:
        raise InputError("--blocks names no suite")
    return out


def build_stream(data: str | Path, blocks: str = DEFAULT_BLOCKS, per_block: int = 0
                 ) -> tuple[list[StreamRequest], dict]:
    """Requests in blocks of one suite each, in the order `blocks` names them. A suite named
    again continues where its last block stopped (a domain that comes back brings new
    requests, never the same ones again). A block without a count takes what is left of its
    suite, at most `per_block` when that is set. Returns (stream, the data's settings)."""
    meta = read_meta(data)
    if not meta.get("complete"):
        raise InputError(f"{data} is an unfinished collection: rerun `adaspec s2d data`")
    plan = parse_blocks(blocks)
    by_suite: dict[str, list] = {}
    for r in read_rows(data):
        if r.output:
            by_suite.setdefault(r.suite, []).append(r)
    unknown = sorted({n for n, _ in plan if n not in by_suite})
    if unknown:
        raise InputError(f"no rows of {unknown} in {data} (it has {sorted(by_suite)})")
    used = dict.fromkeys(by_suite, 0)
    stream: list[StreamRequest] = []
    for name, n in plan:
        rows = sorted(by_suite[name], key=lambda r: r.prompt_id)[used[name]:]
        if not rows or n > len(rows):  # an explicit count is a promise
            raise InputError(f"block {name}:{n or 'all'} wants more requests than {data} has "
                             f"left of {name} ({len(rows)} of {len(by_suite[name])}): collect "
                             f"more with `adaspec s2d data --suite {name}:N` or ask for fewer")
        chosen = rows[: n or per_block or len(rows)]
        used[name] += len(chosen)
        for r in chosen:
            stream.append(StreamRequest(len(stream), r.prompt_id, name, list(r.prompt_ids),
                                        list(r.output)))
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
