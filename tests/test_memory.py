"""`backends/memory.Trimmer`: freed heap pages go back to the system, at most every few
seconds. Measured in a child process, whose heap no other test shares."""

from __future__ import annotations

import subprocess
import sys

import pytest

from adaspec.backends.memory import Trimmer


def test_a_trim_waits_its_interval():
    now = [0.0]
    trimmer = Trimmer(every_s=5.0, clock=lambda: now[0])
    if not trimmer.available:
        pytest.skip("not glibc: nothing to trim")
    assert not trimmer.maybe()
    now[0] = 4.9
    assert not trimmer.maybe()
    now[0] = 5.0
    assert trimmer.maybe() and trimmer.trims == 1
    now[0] = 9.0
    assert not trimmer.maybe()  # five seconds from the last trim, not from the start
    now[0] = 10.0
    assert trimmer.maybe() and trimmer.trims == 2


# A heap left holding freed pages as a server's is: one large block freed (glibc then serves
# blocks up to its size from the heap, not from their own mappings), 300 blocks of about a
# logits row (600 KB) written and freed but the last (which pins the heap's top).
HEAP = """
import ctypes, sys
from adaspec.backends.memory import Trimmer

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

libc.free(libc.malloc(32 << 20))
blocks = [libc.malloc(600_000) for _ in range(300)]
for b in blocks:
    ctypes.memset(b, 1, 600_000)
for b in blocks[:-1]:
    libc.free(b)
held = rss()
trimmer = Trimmer(every_s=0.0)
trimmer.maybe() if sys.argv[1] == "trim" else None
print(held, rss())
"""


@pytest.mark.parametrize("trim", [True, False])
def test_freed_pages_go_back_to_the_system(trim):
    if not Trimmer().available:
        pytest.skip("not glibc: nothing to trim")
    out = subprocess.run([sys.executable, "-c", HEAP, "trim" if trim else "keep"],
                         capture_output=True, text=True, check=True).stdout
    held, after = map(float, out.split())
    if trim:
        assert held - after > 100  # MB: most of the 180 freed
    else:  # the negative control: without the trim the heap keeps them
        assert held - after < 20
