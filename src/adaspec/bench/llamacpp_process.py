"""The bench's llama.cpp decoder in a child process.

Two reasons to keep llama.cpp out of the bench process: its OpenMP thread pool and torch's
live side by side there (two runtimes on the same two cores), and a crash inside llama.cpp
(the AMX segfault seen in this VM) would kill the whole bench. In a spawned child the torch
methods run alone, and a dead child is a LlamaCppUnavailable, not a lost run. Timing is taken
inside the child, exactly as in-process (the pipe round trip is outside the clock).
"""

from __future__ import annotations

import contextlib
import multiprocessing
from dataclasses import asdict
from pathlib import Path

from adaspec.metrics import RequestStats
from adaspec.models.llamacpp import LlamaCppUnavailable


def _serve(conn, gguf: str, n_threads: int) -> None:
    """Child: load the decoder, then answer (prompt ids, max new tokens, EOS ids) requests."""
    from adaspec.bench.llamacpp import LlamaCppDecoder

    try:
        decoder = LlamaCppDecoder(gguf, n_threads)
    except Exception as exc:  # every failure goes back to the parent as one line
        conn.send((False, str(exc)))
        return
    conn.send((True, None))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        try:
            ids, stats = decoder.generate(*request)
            conn.send((True, (ids, asdict(stats))))
        except Exception as exc:
            conn.send((False, str(exc)))


class ProcessDecoder:
    """`LlamaCppDecoder.generate` served by a spawned child process."""

    def __init__(self, gguf: str | Path, n_threads: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, str(gguf), n_threads), daemon=True)
        self._proc.start()
        child.close()
        self._receive("loading")

    def _receive(self, doing: str):
        try:
            ok, payload = self._conn.recv()
        except (EOFError, ConnectionError):
            self._proc.join(timeout=5)
            raise LlamaCppUnavailable(
                f"the llama.cpp process died while {doing} (exit code {self._proc.exitcode})"
            ) from None
        if not ok:
            raise LlamaCppUnavailable(f"llama.cpp failed while {doing}: {payload}")
        return payload

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: list[int]
    ) -> tuple[list[int], RequestStats]:
        with contextlib.suppress(OSError):  # a dead child: _receive says so
            self._conn.send(([int(t) for t in prompt_ids], max_new_tokens, list(eos_token_ids)))
        ids, stats = self._receive("decoding")
        stats["steps"] = [tuple(s) for s in stats.get("steps", [])]
        return ids, RequestStats(**stats)

    def close(self) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.kill()
        self._conn.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
