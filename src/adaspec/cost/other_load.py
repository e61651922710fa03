"""How busy the rest of the machine was while a cost was measured.

A cost profile is measured once per configuration and read back by every run after it, so
one measured while something else kept the cores busy (a build, a test suite in another
worker, a neighbour's steal on a VM) prices every call too dear for good: on a 2-vCPU EPYC a
profile measured beside the test suite read the target's step at 205 ms against 49 ms alone.
`OtherLoad` counts, over a measurement, the CPU time of every process outside this one's
tree plus the hypervisor's steal, as a share of the machine. A cost measured above `BUSY` is
used by the run that measured it and stored with its share; the next run measures it again if
the machine is quiet by then (`measure_again`), else keeps it (a machine that is always this
busy is the one it prices). Linux only (`/proc`); elsewhere the share reads 0.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

BUSY = 0.25  # the share of the machine other processes may take while a cost is measured
MIN_SECONDS = 1.0  # a window shorter than this says nothing (the counters tick at 100 Hz)
PROBE_SECONDS = 1.0


def _machine_busy_ticks() -> int:
    """Clock ticks the machine's CPUs spent busy (steal counted: a neighbour's time)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return user + nice + system + irq + softirq + steal


def _processes() -> dict[int, tuple[int, int]]:
    """pid: (parent pid, clock ticks of user + system time) of every process now."""
    out: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        rest = stat[stat.rindex(")") + 2:].split()  # the fields after "pid (comm) "
        out[int(entry.name)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
    return out


def tree(root: int, processes: dict[int, tuple[int, int]]) -> set[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in processes.items():
        children.setdefault(ppid, []).append(pid)
    mine, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in mine:
                mine.add(child)
                todo.append(child)
    return mine


def _tree_ticks(root: int) -> int:
    """Clock ticks (user + system) of process `root` and every process below it."""
    processes = _processes()
    return sum(processes[pid][1] for pid in tree(root, processes) if pid in processes)


def sample() -> tuple[float, int, int] | None:
    """(now, the machine's busy ticks, this process tree's ticks), or None off Linux."""
    try:
        return time.monotonic(), _machine_busy_ticks(), _tree_ticks(os.getpid())
    except (OSError, ValueError, IndexError):
        return None


def share_between(start: tuple[float, int, int] | None, end: tuple[float, int, int] | None
                  ) -> float:
    """The share of the machine's CPU time that other processes took between two samples
    (0 when either is missing or the window is too short to tell)."""
    if start is None or end is None or end[0] - start[0] < MIN_SECONDS:
        return 0.0
    capacity = (end[0] - start[0]) * os.sysconf("SC_CLK_TCK") * (os.cpu_count() or 1)
    others = (end[1] - start[1]) - (end[2] - start[2])
    return max(0.0, min(1.0, others / capacity))


class OtherLoad:
    """`with OtherLoad() as load: measure()`, then `load.share`."""

    share = 0.0

    def __enter__(self) -> OtherLoad:
        self._start = sample()
        return self

    def __exit__(self, *exc: object) -> None:
        self.share = share_between(self._start, sample())


def others_now(seconds: float = PROBE_SECONDS) -> float:
    """Other processes' share of the machine over the next `seconds`."""
    with OtherLoad() as load:
        time.sleep(seconds)
    return load.share


def measure_again(stored_share: float) -> bool:
    """Whether a stored cost measured with others taking `stored_share` of the machine
    should be measured again now (it was busy then, it is quiet now)."""
    return stored_share > BUSY and others_now() <= BUSY


def busy_note(share: float, what: str) -> str:
    return (f"other processes took {share:.0%} of this machine's CPU while {what} was "
            "measured, so its prices may read dear; it is used now and measured again by "
            "the first run that finds the machine quiet (`adaspec profile --force` now)")


class _Measured(Protocol):
    others_share: float


M = TypeVar("M", bound=_Measured)


def measured(measure: Callable[[], M], what: str, say: Callable[[str], None]) -> M:
    """`measure()`, with the share of the machine others took meanwhile set on its result
    (`others_share`) and said (`busy_note`) when it is above BUSY."""
    with OtherLoad() as load:
        result = measure()
    result.others_share = round(load.share, 3)
    if load.share > BUSY:
        say(busy_note(load.share, what))
    return result
