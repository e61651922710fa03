"""A model backend served by a spawned child process.

Why: llama.cpp's thread pool and torch's live badly in one process on a small CPU. Measured
on the 2-core EPYC, a llama.cpp 0.5B draft step beside a torch int8 target in the same
process took 77-92 ms instead of 45, and the target's 3-token pass 640-1190 ms instead of
300-400. In a child, each runtime owns its threads, and while one works the other waits on a
pipe. A crash inside the child (llama.cpp's AMX segfault in this VM) is a clear error in the
parent, not a dead process.

The child is a fresh interpreter (`python -m adaspec.models.process_backend FD`, not
multiprocessing's spawn, which would re-run the caller's main module). It builds its backend
from a picklable factory (a module-level function and its arguments) sent over a socket pair;
every call is one small message each way; logits come back through a shared memory file
(memfd), so a verification's rows of 151,936 floats are one copy, not a pickled stream.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from adaspec.errors import AdaspecError, InputError
from adaspec.models.backend import ForwardOutput, ModelBackend

_ATTRIBUTES = ("name", "vocab_size", "max_context", "num_layers", "hidden_size",
               "bytes_per_forward", "supports_trees", "has_hidden_states")


class BackendProcessError(AdaspecError):
    """The child process serving a backend failed to load, or died."""


class _SharedRows:
    """Float32 rows in a memory file both processes map: the child writes (growing the file
    when a call returns more rows than fit), the parent reads (remapping after growth)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map: mmap.mmap | None = None

    def _mapped(self) -> mmap.mmap:
        size = os.fstat(self.fd).st_size
        if self._map is None or len(self._map) != size:
            if self._map is not None:
                self._map.close()
            self._map = mmap.mmap(self.fd, size)
        return self._map

    def write(self, rows: torch.Tensor) -> tuple[int, int]:
        array = rows.detach().to(torch.float32).contiguous().numpy()
        if array.nbytes > os.fstat(self.fd).st_size:
            os.ftruncate(self.fd, array.nbytes)
        view = np.frombuffer(self._mapped(), dtype=np.float32, count=array.size)
        view[:] = array.reshape(-1)
        return array.shape[0], array.shape[1]

    def read(self, rows: int, columns: int) -> torch.Tensor:
        view = np.frombuffer(self._mapped(), dtype=np.float32, count=rows * columns)
        return torch.from_numpy(view.reshape(rows, columns).copy())

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
        os.close(self.fd)


def _serve(conn: Connection, rows: _SharedRows, factory: Callable[..., ModelBackend],
           args: tuple) -> None:
    """Child: build the backend, report its attributes, then answer calls until EOF/None."""
    try:
        backend = factory(*args)
    except Exception as exc:  # every failure goes back to the parent as one line
        conn.send((False, f"{type(exc).__name__}: {exc}"))
        return
    conn.send((True, {a: getattr(backend, a) for a in _ATTRIBUTES}))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        op, payload = request
        try:
            if op == "forward":
                reply: Any = rows.write(backend.forward(torch.tensor(payload)).logits)
            elif op == "prefill":
                reply = rows.write(backend.prefill(torch.tensor(payload)).logits)
            elif op == "truncate":
                backend.truncate(payload)
                reply = None
            elif op == "keep":
                backend.keep(torch.tensor(payload))
                reply = None
            else:
                raise ValueError(f"unknown call {op!r}")
            conn.send((True, (reply, backend.cache_len)))
        except InputError as exc:
            conn.send((False, ("input", str(exc))))
        except Exception as exc:
            conn.send((False, ("error", f"{type(exc).__name__}: {exc}")))


class ProcessBackend(ModelBackend):
    """`factory(*args)`'s backend, run in a spawned child; chains only (no tree masks, no
    hidden states cross the pipe)."""

    supports_trees = False
    has_hidden_states = False

    def __init__(self, factory: Callable[..., ModelBackend], *args: Any) -> None:
        ours, theirs = socket.socketpair()
        self._rows = _SharedRows(os.memfd_create("adaspec-logits"))
        fds = (theirs.fileno(), self._rows.fd)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, *map(str, fds)], pass_fds=fds
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        with contextlib.suppress(OSError):
            self._conn.send((factory, args))
        attributes = self._receive("loading")
        for key, value in attributes.items():
            if key not in ("supports_trees", "has_hidden_states"):
                setattr(self, key, value)
        self._len = 0

    def _receive(self, doing: str) -> Any:
        try:
            ok, payload = self._conn.recv()
        except (EOFError, ConnectionError):
            raise BackendProcessError(
                f"the process serving the model died while {doing} "
                f"(exit code {_exit_code(self._proc)})"
            ) from None
        if ok:
            return payload
        if doing == "loading":
            raise BackendProcessError(f"the model process failed while loading: {payload}")
        kind, message = payload
        if kind == "input":
            raise InputError(message)
        raise BackendProcessError(f"the model process failed while {doing}: {message}")

    def _call(self, op: str, payload: Any) -> Any:
        with contextlib.suppress(OSError):  # a dead child: _receive says so
            self._conn.send((op, payload))
        reply, self._len = self._receive(op)
        return reply

    def _logits(self, shape: tuple[int, int]) -> torch.Tensor:
        return self._rows.read(*shape)

    @property
    def cache_len(self) -> int:
        return self._len

    def reset(self) -> None:
        self.truncate(0)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        hidden_layer: int | None = None,
    ) -> ForwardOutput:
        if tree_mask is not None or hidden_layer is not None:
            raise InputError(
                "a model in a child process scores chains only (no token trees, no hidden "
                "states)"
            )
        ids = [int(t) for t in tokens.reshape(-1)]
        if positions is not None and positions.reshape(-1).tolist() != list(
            range(self._len, self._len + len(ids))
        ):
            raise InputError("a model in a child process feeds tokens right after its cache")
        return ForwardOutput(logits=self._logits(self._call("forward", ids)))

    def prefill(self, tokens: torch.Tensor, hidden_layer: int | None = None) -> ForwardOutput:
        if hidden_layer is not None:
            raise InputError("a model in a child process gives no hidden states")
        ids = [int(t) for t in tokens.reshape(-1)]
        return ForwardOutput(logits=self._logits(self._call("prefill", ids)))

    def truncate(self, length: int) -> None:
        if length < self._len:
            self._call("truncate", int(length))

    def keep(self, indices: torch.Tensor) -> None:
        self._call("keep", [int(i) for i in indices.reshape(-1)])

    def close(self) -> None:
        """Stop the child (also done at exit: it is a daemon)."""
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._conn.send(None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if not self._conn.closed:
            self._conn.close()
            self._rows.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _exit_code(proc: subprocess.Popen) -> int | None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        return proc.wait(timeout=5)
    return None


if __name__ == "__main__":
    _conn = Connection(int(sys.argv[1]))
    _factory, _args = _conn.recv()
    _serve(_conn, _SharedRows(int(sys.argv[2])), _factory, _args)
