"""Hand the heap's free pages back to the system every few seconds (glibc `malloc_trim`).

A round's logits are megabytes (151,936 floats a row, up to 17 rows a request) and their
size changes with every round, so glibc keeps what a large round freed inside its heap: a
server's resident memory then follows the largest rounds it has seen, not what it holds.
Measured in a 16-client soak (experiments/results/concurrency-sweep-xeon-amx/, session 27):
one trim a minute gave back 30-80 MB of the server's process. Freed pages come back on
their next use at a page fault each; once every few seconds that is far below a round's
time. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

EVERY_S = 5.0  # seconds between two trims (at least)


def _load_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _load_trim()


class Trimmer:
    """`maybe()` trims when `every_s` seconds have passed since the last trim (call it between
    units of work: a round, a runtime call)."""

    def __init__(self, every_s: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._last = clock()
        self.trims = 0

    @property
    def available(self) -> bool:
        return _TRIM is not None

    def maybe(self) -> bool:
        """Trim if it is time; whether it did."""
        now = self._clock()
        if now - self._last < self.every_s or _TRIM is None:
            return False
        self._last = now
        _TRIM(0)
        self.trims += 1
        return True
