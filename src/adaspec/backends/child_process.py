"""An object built and served in a child process: llama.cpp beside torch.

Why: llama.cpp's thread pool and torch's live badly in one process on a small CPU (measured
on the 2-core EPYC: a llama.cpp 0.5B draft step beside a torch int8 target took 77-92 ms
instead of 45, the target's 3-token pass 640-1190 ms instead of 300-400). In a child, each
runtime owns its threads, and while one works the other waits on a socket. A crash inside
the child (llama.cpp's AMX segfault in one VM) is a one-line error in the parent.

The child is a fresh interpreter (`python -m adaspec.backends.child_process FD ...`), not
multiprocessing's spawn, which would re-run the caller's main module. It builds the object
from a picklable factory (a class or module-level function and its arguments), then answers
method calls, one message each way, until the parent closes the socket.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from adaspec.core.openmp import spin_settings
from adaspec.errors import AdaspecError, InputError


class ChildProcessFailed(AdaspecError):
    """The child process failed to build its object, failed a call, or died."""


def _serve(conn: Connection) -> None:
    """Child: build the object, then answer (method, args) calls until EOF or None."""
    try:
        factory, args = conn.recv()
        served = factory(*args)
    except Exception as exc:  # every failure goes back to the parent as one line
        conn.send((False, ("error", f"{type(exc).__name__}: {exc}")))
        return
    conn.send((True, None))
    from adaspec.backends.memory import Trimmer

    trimmer = Trimmer()  # what a large call freed goes back to the system
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        method, args = request
        try:
            conn.send((True, getattr(served, method)(*args)))
        except InputError as exc:
            conn.send((False, ("input", str(exc))))
        except Exception as exc:
            conn.send((False, ("error", f"{type(exc).__name__}: {exc}")))
        trimmer.maybe()  # after the answer: the caller does not wait for it


def child_env() -> dict[str, str]:
    """The child's environment: ours, with OpenMP's spin count cut where the user did not
    set how its threads wait (`core/openmp.py`: two children's busy-waiting threads slow
    each other's next forward)."""
    env = dict(os.environ)
    env.update(spin_settings(env))
    return env


class ChildProcess:
    """`factory(*args)` served in a child process; `call(method, *args)` runs one of its
    methods there. `pass_fds` are inherited by the child (e.g. shared memory)."""

    def __init__(
        self,
        factory: Callable[..., Any],
        *args: Any,
        pass_fds: Sequence[int] = (),
        error: type[AdaspecError] = ChildProcessFailed,
        wait: bool = True,
    ) -> None:
        """wait=False returns as soon as the child is started; `ready()` waits for its
        object (so several children can load at once)."""
        self._error = error
        self._loaded = False
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno())],
            pass_fds=(theirs.fileno(), *pass_fds), env=child_env(),
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        with contextlib.suppress(OSError):  # a child dead at once: _receive says so
            self._conn.send((factory, args))
        if wait:
            self.ready()

    def ready(self) -> None:
        """Wait until the child has built its object (at once if it has)."""
        if not self._loaded:
            self._receive("loading")
            self._loaded = True

    def _receive(self, doing: str) -> Any:
        try:
            ok, payload = self._conn.recv()
        except (EOFError, ConnectionError):
            code = None
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self._proc.wait(timeout=5)
            raise self._error(
                f"the child process died while {doing} (exit code {code})"
            ) from None
        if ok:
            return payload
        kind, message = payload
        if kind == "input":
            raise InputError(message)
        raise self._error(f"the child process failed while {doing}: {message}")

    def call(self, method: str, *args: Any) -> Any:
        self.ready()
        with contextlib.suppress(OSError):  # a dead child: _receive says so
            self._conn.send((method, args))
        return self._receive(method)

    def close(self) -> None:
        """Stop the child (politely, then by force)."""
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._conn.send(None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


if __name__ == "__main__":
    # Ctrl-C reaches the whole process group: the parent handles it and closes the child,
    # which must not print a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A parent gone mid-call (killed) leaves nobody to answer: exit without a traceback.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        _serve(Connection(int(sys.argv[1])))
    # Nothing left to save: skip the interpreter's teardown (freeing a loaded model took
    # about 0.9 s, which the parent would wait for on exit).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
