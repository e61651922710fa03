"""The suite's own order (tests/file_order.py): files by measured seconds, longest first, each
file's tests in their own order; only the order changes."""

from __future__ import annotations

import json
from types import SimpleNamespace

from . import file_order


def items(*nodeids: str) -> list:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_files_start_longest_first_and_keep_their_tests_in_order():
    got = file_order.longest_first(
        items("a.py::t1", "b.py::t1", "a.py::t2", "c.py::t1", "b.py::t2", "d.py::t1"),
        {"a.py": 5.0, "b.py": 60.0, "c.py": 1.0})
    # d.py is not listed: it counts as the median file (5 s), after a.py (listed first)
    assert [i.nodeid for i in got] == ["b.py::t1", "b.py::t2", "a.py::t1", "a.py::t2",
                                       "d.py::t1", "c.py::t1"]


def test_without_figures_the_collection_order_stays():
    ids = ["a.py::t1", "b.py::t1", "a.py::t2"]
    assert [i.nodeid for i in file_order.longest_first(items(*ids), {})] == \
        ["a.py::t1", "a.py::t2", "b.py::t1"]  # a file's tests together, files as collected


def test_the_recorder_sums_each_files_phases(tmp_path):
    out = tmp_path / "seconds.json"
    rec = file_order.Recorder(out)
    for nodeid, seconds in [("a.py::t1", 1.25), ("a.py::t1", 0.5), ("b.py::t", 2.0),
                            ("a.py::t2", 3.0)]:
        rec.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds))
    rec.pytest_sessionfinish()
    assert json.loads(out.read_text()) == {"a.py": 4.8, "b.py": 2.0}


def test_the_shipped_figures_name_files_that_exist():
    from pathlib import Path

    here = Path(__file__).parent
    figures = file_order.expected_seconds()
    assert figures, "tests/file_seconds.json is missing or empty"
    assert all((here.parent / name).is_file() for name in figures), \
        [n for n in figures if not (here.parent / n).is_file()]
