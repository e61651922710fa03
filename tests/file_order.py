"""The order test files start in: the longest first, so two workers finish together.

`make test` runs the suite in two workers, a file at a time each (`--dist loadfile`). xdist
hands files out in the order it gets them; left to itself it orders them by their number of
tests, so a file of four slow tests (the real model pair) could start last and leave one
worker running alone for a minute. Here the files are ordered by how long each took in a
measured run (`file_seconds.json`, seconds of setup, call and teardown summed per file;
files not in it go after the listed ones that take longer than a typical file); only the order
changes, never which tests run or what they assert. `--record-file-seconds PATH` writes
this run's figures in that format (regenerate after adding or slowing a test file).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

SECONDS_FILE = Path(__file__).with_name("file_seconds.json")


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def expected_seconds() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(SECONDS_FILE.read_text()).items()}
    except (OSError, ValueError):
        return {}


def longest_first(items: list[pytest.Item], seconds: dict[str, float]) -> list[pytest.Item]:
    """`items` with their files ordered by expected seconds, longest first (a stable sort:
    the tests of a file keep their order; unlisted files count as a median file)."""
    typical = statistics.median(seconds.values()) if seconds else 0.0
    first_index: dict[str, int] = {}
    for i, item in enumerate(items):
        first_index.setdefault(file_of(item.nodeid), i)

    def key(item: pytest.Item) -> tuple[float, int]:
        name = file_of(item.nodeid)
        return (-seconds.get(name, typical), first_index[name])

    return sorted(items, key=key)


class Recorder:
    """Sums each file's setup, call and teardown seconds (in the controller when xdist runs
    the tests) and writes them at the end of the session."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        rounded = {k: round(v, 1) for k, v in sorted(self.seconds.items())}
        self.path.write_text(json.dumps(rounded, indent=1) + "\n")
