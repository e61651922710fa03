"""llama.cpp's own `llama-server`, driven through its HTTP API as a user's client drives it.

The bench reference method `llama-server:spec=none|ngram-simple|ngram-mod|ngram-map-k|
ngram-map-k4v|draft-simple` (registered in `lab.bench.references`) starts one server per
method (`LlamaServer`: a subprocess on 127.0.0.1 on a free port, ready when `/health` answers
200, its log written to `<bench out>/peers/<method>.log`, stopped when the bench ends or
fails) and sends every prompt to `/completion`:

- the very prompt token ids adaspec encoded (`prompt` takes a list of ids: no text, no BOS
  added), `n_predict` = the bench's new-token budget, `temperature: 0` (greedy), the server's
  own stop on end-of-generation tokens, `stream: true`;
- everything else as the server ships it: its default sampler chain (greedy at temperature 0),
  `cache_prompt` on (a request reuses the KV of the longest common prefix with what a slot
  last held, e.g. the chat template's system prompt, and an MT-bench second turn its first),
  4 slots, weight repacking on, flash attention `auto`.

The server is started with the bench's threads (`-t`, `-tb`), a context of 8192 tokens
(`-c`; adaspec's llama.cpp backends use the same), and for speculation `--spec-type TYPE`
with that type's stock settings; `draft-simple` also `-md DRAFT.gguf --spec-draft-n-max N
--spec-draft-p-min P`.

Measured by the client: the clock starts when the request is sent; the first streamed token
ends the time to first token (`prefill_time`), the final event ends `wall_time`. The server's
own `timings` (prompt_n, prompt_ms, predicted_n, predicted_ms, cache_n, draft_n,
draft_n_accepted) are kept with every request (`PeerStats.timings`). `drafted` / `accepted`
are the server's draft_n / draft_n_accepted; target calls are derived: the prompt's pass plus
one per verification, i.e. 1 + (new tokens - 1 - accepted).

A streamed event carries the one token it adds, except that a token ending inside a UTF-8
character is held back and sent with the next one's text only: when the streamed ids are
fewer than the server's token count, the request is replayed unstreamed with
`return_tokens: true` (outside the clock) for the exact ids.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaspec.core.metrics import RequestStats
from adaspec.errors import InputError
from adaspec.lab.bench.peer_build import (
    NO_AMX,
    SERVER,
    VARIANT_OPTIONS,
    PeerUnavailable,
    build_info,
    cpu_has_amx,
    ensure_server,
    server_binary,
)
from adaspec.lab.bench.references import SERVER_SPECS

# --spec-type values this method runs (llama-server --help lists them; the draft-eagle3 /
# -mtp / -dflash / -dspark types need draft heads these models do not have, ngram-cache a
# lookup cache file).
SPEC_TYPES = SERVER_SPECS
DRAFT_SPEC = "draft-simple"
CONTEXT = 8192  # -c: tokens of KV cache (shared by the server's slots)
HOST = "127.0.0.1"
STARTUP_TIMEOUT = 600.0  # seconds for the model(s) to load
REQUEST_TIMEOUT = 1800.0


SETTLE_S = 5.0  # after a failed request, how long a crashing server may take to exit


@dataclass
class PeerStats(RequestStats):
    """RequestStats of a request served by a peer, with the peer's own timings."""

    timings: dict = field(default_factory=dict)
    replayed_ids: bool = False  # the ids came from an unstreamed replay (see module doc)


def server_args(
    spec: str,
    gguf: str | Path,
    n_threads: int,
    draft_gguf: str | Path | None = None,
    n_max: int = 8,
    p_min: float = 0.75,
    repack: bool = True,
    n_ctx: int = CONTEXT,
) -> list[str]:
    """llama-server's command-line arguments for one method (the host and port excepted)."""
    if spec not in SPEC_TYPES:
        raise InputError(f"llama-server: unknown spec {spec!r}; use one of {'|'.join(SPEC_TYPES)}")
    args = ["-m", str(gguf), "-t", str(n_threads), "-tb", str(n_threads), "-c", str(n_ctx)]
    if not repack:
        args.append("--no-repack")
    if spec == DRAFT_SPEC:
        if draft_gguf is None:
            raise PeerUnavailable("llama-server:spec=draft-simple runs the draft's GGUF and the "
                                  "draft is not one: use a built-in model name or a .gguf path "
                                  "as --draft")
        args += ["--spec-type", spec, "-md", str(draft_gguf), "--spec-draft-n-max", str(n_max),
                 "--spec-draft-p-min", f"{p_min:g}"]
    elif spec != "none":
        args += ["--spec-type", spec]
    return args


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the server's process before it runs (Linux): SIGTERM when the bench dies, so a
    killed bench leaves no server behind."""
    with contextlib.suppress(Exception):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def _log_tail(path: Path, n: int = 3) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
    return " | ".join((errors or lines)[-n:])[:400]


class LlamaServer:
    """One llama-server process on 127.0.0.1 and a free port; its stdout and stderr go to
    `log_path`. `start()` returns when /health answers 200; `close()` stops it (and is safe to
    call twice); a server that dies is a PeerUnavailable quoting its log."""

    def __init__(self, binary: str | Path, args: list[str], log_path: str | Path,
                 startup_timeout: float = STARTUP_TIMEOUT,
                 env: dict[str, str] | None = None) -> None:
        """env: variables set for the server's process on top of this one's."""
        self.binary = Path(binary)
        self.args = list(args)
        self.env = dict(env or {})
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.died_with: int | None = None  # the exit code of a process that ended by itself

    def start(self) -> LlamaServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):  # another process may take the free port before the server
            self.port = free_port()
            with self.log_path.open("ab") as log:
                log.write(f"$ {self.binary} {' '.join(self.args)} --host {HOST} --port "
                          f"{self.port}\n".encode())
                log.flush()
                self.proc = subprocess.Popen(
                    [str(self.binary), *self.args, "--host", HOST, "--port", str(self.port)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent,
                    env={**os.environ, **self.env} if self.env else None,
                )
            try:
                self._wait_ready()
                return self
            except PeerUnavailable:
                tail = _log_tail(self.log_path, 20)
                self.close()
                if attempt < 2 and ("bind" in tail.lower() or "address" in tail.lower()):
                    continue
                raise
        raise AssertionError("unreachable")

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                status, _ = self.request("GET", "/health", timeout=5)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise PeerUnavailable(f"{SERVER} did not become ready in {self.startup_timeout:.0f} s "
                              f"(log: {self.log_path})")

    def exit_code(self, settle: float = 0.0) -> int | None:
        """The server's exit code, or None while it runs. `settle`: after a dropped
        connection, how long to give a crashing server to finish dying (its socket closes
        before the process is gone)."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=settle) if settle > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None

    def check_alive(self, settle: float = 0.0) -> None:
        if self.proc is None:
            raise PeerUnavailable(f"{SERVER} is not running")
        code = self.exit_code(settle)
        if code is not None:
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            raise PeerUnavailable(f"{SERVER} stopped ({how}): {_log_tail(self.log_path)} "
                                  f"(log: {self.log_path})")

    @property
    def crashed(self) -> bool:
        """Killed by a signal (a native crash such as a segfault or an abort), while running
        or before `close` (a start that failed closes the process)."""
        code = self.exit_code(SETTLE_S) if self.proc is not None else self.died_with
        return (code or 0) < 0

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(HOST, self.port, timeout=timeout)

    def request(self, method: str, path: str, body: dict | None = None,
                timeout: float = REQUEST_TIMEOUT) -> tuple[int, dict]:
        conn = self._connection(timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data else {}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            try:
                return resp.status, json.loads(raw or b"{}")
            except ValueError:
                return resp.status, {"raw": raw.decode(errors="replace")}
        finally:
            conn.close()

    def stream(self, path: str, body: dict,
               timeout: float = REQUEST_TIMEOUT) -> Iterator[tuple[float, dict]]:
        """POST `body` with `stream: true`; yields (arrival time, event) per server-sent
        event, the clock read as each one arrives."""
        conn = self._connection(timeout)
        try:
            conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode(),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise PeerUnavailable(f"{SERVER} answered {resp.status}: "
                                      f"{resp.read()[:300].decode(errors='replace')}")
            while True:
                line = resp.readline()
                if not line:
                    return
                now = time.perf_counter()
                line = line.strip()
                if not line or line.startswith(b":"):
                    continue
                if line.startswith(b"error:"):
                    raise PeerUnavailable(f"{SERVER}: {line[6:].decode(errors='replace')}")
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                event = json.loads(payload)
                if "error" in event:
                    raise PeerUnavailable(f"{SERVER}: {event['error']}")
                yield now, event
        finally:
            conn.close()

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        self.died_with = proc.poll()
        if self.died_with is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _target_calls(new_tokens: int, accepted: int) -> int:
    """The prompt's pass plus one per verification: each pass after the first yields one
    token plus the draft tokens it accepted."""
    return 1 + max(0, new_tokens - 1 - accepted) if new_tokens else 0


class LlamaServerDecoder:
    """A bench reference method served by llama-server: `generate(prompt_ids,
    max_new_tokens, eos_token_ids)` -> (new token ids, PeerStats), as every bench decoder.

    The server starts in the constructor. Its weight repacking is on (its default) unless
    `repack` is False; with `repack=None`, a server killed by a signal while it starts or
    during its first request (the warm-up) falls back (`fall_back`) and `repack_choice` says
    how. `without_amx`: gives llama.cpp built without its AMX kernels (`amx_free_build`), the
    first fall-back where the crash may be llama.cpp's AMX path."""

    def __init__(self, binary: str | Path, spec: str, gguf: str | Path, n_threads: int,
                 log_path: str | Path, draft_gguf: str | Path | None = None, n_max: int = 8,
                 p_min: float = 0.75, repack: bool | None = None, n_ctx: int = CONTEXT,
                 without_amx: Callable[[], Path] | None = None) -> None:
        from adaspec.backends.llamacpp.backend import RepackChoice

        self.spec = spec
        self.binary = self._stock = Path(binary)
        self._without_amx = without_amx
        self.log_path = Path(log_path)
        self._settings: dict[str, Any] = dict(
            spec=spec, gguf=gguf, n_threads=n_threads, draft_gguf=draft_gguf, n_max=n_max,
            p_min=p_min, n_ctx=n_ctx)
        self._may_fall_back = repack is None
        self._served = 0
        self.repack_choice = RepackChoice(True, f"{SERVER}'s default") if repack is None else \
            RepackChoice(repack, "given")
        self.server = self._server()
        try:
            self.server.start()
        except PeerUnavailable:  # a native crash while it loads: the fall-back, if allowed
            if not self.fall_back("while starting"):
                raise

    def _args(self) -> list[str]:
        """The server's command-line arguments (host and port aside)."""
        return server_args(**self._settings, repack=self.repack_choice.on)

    def _server(self) -> LlamaServer:
        """The server process to start (not started)."""
        return LlamaServer(self.binary, self._args(), self.log_path)

    @property
    def fell_back(self) -> bool:
        """The server runs otherwise than it was started: a crash with repacking on moved it
        to the build without AMX kernels, or turned repacking off."""
        return self._may_fall_back and (not self.repack_choice.on or self.binary != self._stock)

    def fall_back(self, when: str = "at its warm-up") -> bool:
        """After a native crash with repacking on, before any request was served (while
        starting, or at the warm-up): restart from llama.cpp built without its AMX kernels,
        repacking still on, where `without_amx` gives one (once); else, or when that crashes
        too, the stock build without repacking."""
        if not (self._may_fall_back and self.repack_choice.on and not self._served
                and self.server.crashed):
            return False
        from adaspec.backends.llamacpp.backend import RepackChoice

        self.server.close()
        crash = (f"{SERVER}{' (built without AMX)' if self.binary != self._stock else ''} was "
                 f"killed by signal {-(self.server.died_with or 0)} {when} with repacking on")
        amx_free = self._amx_free_build()
        if amx_free is not None:
            self.binary = amx_free
            self.repack_choice = RepackChoice(
                True, f"{crash}, on a CPU with AMX: restarted from llama.cpp built without its "
                      "AMX kernels (-mno-amx-*), repacking still on")
        else:
            self.binary = self._stock
            self.repack_choice = RepackChoice(False, f"{crash}: restarted with --no-repack")
        self._note(self.repack_choice.reason)
        self.server = self._server()
        try:
            self.server.start()
        except PeerUnavailable:
            if not self.fall_back("while starting"):
                raise
        return True

    def _amx_free_build(self) -> Path | None:
        """The build without AMX kernels, the first time it is asked for and given (None
        after, or when building it failed: said in the log)."""
        build, self._without_amx = self._without_amx, None
        if build is None:
            return None
        try:
            return build()
        except PeerUnavailable as exc:
            self._note(f"llama-server without AMX could not be built: {exc}")
            return None

    def _note(self, text: str) -> None:
        with self.log_path.open("a") as log:
            log.write(f"\nadaspec: {text}\n")

    def warm_up(self, prompt_ids: list[int], max_new_tokens: int,
                eos_token_ids: list[int]) -> None:
        """Warm the server up without leaving this prompt in its cache: the warm-up sends the
        prompt's ids reversed (the same length, no common prefix), so the first measured
        request is not served from the warm-up's KV."""
        self.generate(list(reversed(prompt_ids)), max_new_tokens, eos_token_ids)

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 eos_token_ids: list[int]) -> tuple[list[int], PeerStats]:
        try:
            ids, stats = self._generate(prompt_ids, max_new_tokens)
        except (PeerUnavailable, OSError, http.client.HTTPException) as exc:
            if self.fall_back():
                ids, stats = self._generate(prompt_ids, max_new_tokens)
            else:
                self.server.check_alive(SETTLE_S)  # a dead server: its log's last lines
                if isinstance(exc, PeerUnavailable):
                    raise
                raise PeerUnavailable(f"{SERVER} request failed: {exc}") from None
        self._served += 1
        return ids, stats

    def _body(self, prompt_ids: list[int], max_new_tokens: int) -> dict:
        return {"prompt": [int(t) for t in prompt_ids], "n_predict": int(max_new_tokens),
                "temperature": 0.0}

    def _generate(self, prompt_ids: list[int], max_new_tokens: int
                  ) -> tuple[list[int], PeerStats]:
        body = self._body(prompt_ids, max_new_tokens)
        ids: list[int] = []
        final: dict[str, Any] = {}
        first = None
        t_start = time.perf_counter()
        t_end = t_start
        for now, event in self.server.stream("/completion", body):
            tokens = event.get("tokens") or []
            if tokens and first is None:
                first = now
            ids += [int(t) for t in tokens]
            if event.get("stop"):
                final, t_end = event, now
                break
        else:
            self.server.check_alive()
            raise PeerUnavailable(f"{SERVER}: the stream ended without a final event")
        timings: dict[str, Any] = dict(final.get("timings") or {})
        predicted = int(final.get("tokens_predicted", timings.get("predicted_n", len(ids))))
        replayed = False
        if predicted != len(ids):
            status, answer = self.server.request(
                "POST", "/completion", {**body, "stream": False, "return_tokens": True})
            again = [int(t) for t in answer.get("tokens") or []]
            if status != 200 or len(again) != predicted:
                raise PeerUnavailable(f"{SERVER}: streamed {len(ids)} token ids of {predicted} "
                                      "and the unstreamed replay did not give them all")
            ids, replayed = again, True
        accepted = int(timings.get("draft_n_accepted", 0))
        stats = PeerStats(
            prompt_tokens=len(prompt_ids),
            new_tokens=len(ids),
            target_calls=_target_calls(len(ids), accepted),
            drafted=int(timings.get("draft_n", 0)),
            accepted=accepted,
            wall_time=t_end - t_start,
            prefill_time=(first if first is not None else t_end) - t_start,
            timings=timings,
            replayed_ids=replayed,
        )
        # the server does not split drafting from verifying: all of decoding counts as verify
        stats.verify_time = max(0.0, stats.wall_time - stats.prefill_time)
        stats.timings["stop_type"] = final.get("stop_type")
        stats.timings["tokens_cached"] = final.get("tokens_cached")
        return ids, stats

    def describe(self) -> dict:
        """What ran: the binary, its build and its arguments (for the results)."""
        variant = next((v for v in VARIANT_OPTIONS if self.binary == server_binary(variant=v)),
                       None)
        info = build_info(variant=variant) if variant is not None else None
        return {"binary": str(self.binary), "build": (info or {}).get("variant"),
                "args": self.server.args,
                "url": f"http://{HOST}:{self.server.port}", "log": str(self.log_path),
                "llama_cpp_commit": (info or {}).get("llama_cpp_commit"),
                "llama_cpp_python": (info or {}).get("llama_cpp_python"),
                "repack": self.repack_choice.as_dict()}

    def close(self) -> None:
        self.server.close()

    def __del__(self) -> None:  # a decoder dropped without close() stops its server too
        with contextlib.suppress(Exception):
            self.close()


def open_server_decoder(
    gguf: str | Path | None,
    temperature: float,
    params: dict,
    draft: str | None,
    log_path: str | Path,
    n_threads: int | None = None,
    repack: bool | None = None,
) -> LlamaServerDecoder:
    """The llama-server decoder of one bench method: builds the binary on first use, checks
    what the method needs (greedy, a GGUF target, the draft's GGUF for draft-simple) and
    starts the server. PeerUnavailable / LlamaCppUnavailable say why it cannot run."""
    from adaspec.backends.gguf import LlamaCppUnavailable, gguf_file
    from adaspec.backends.weights import llama_threads
    from adaspec.lab.bench.llamacpp_reference import check_greedy_gguf

    spec = str(params.get("spec", "none"))
    if spec not in SPEC_TYPES:
        raise InputError(f"llama-server: unknown spec {spec!r}; use one of {'|'.join(SPEC_TYPES)}")
    check_greedy_gguf(gguf, temperature)
    assert gguf is not None  # check_greedy_gguf refuses None
    draft_gguf = None
    if spec == DRAFT_SPEC:
        draft_gguf = gguf_file(draft) if draft else None
        if draft_gguf is None:
            raise LlamaCppUnavailable(
                "spec=draft-simple runs the draft's GGUF file and the draft is not one: use a "
                "built-in model name or a .gguf path as --draft"
            )
    binary = os.environ.get("ADASPEC_LLAMA_SERVER") or ensure_server()
    return LlamaServerDecoder(
        binary, spec, gguf, n_threads or llama_threads(), log_path, draft_gguf,
        int(params.get("n_max", 8)), float(params.get("p_min", 0.75)), repack,
        without_amx=amx_free_build(binary),
    )


def amx_free_build(binary: str | Path) -> Callable[[], Path] | None:
    """For the stock build on a CPU with AMX, where llama.cpp's AMX kernels can crash at the
    first graph: what returns llama.cpp built without them (building it the first time,
    about 6 minutes; `adaspec bench build-peers --without-amx` builds it ahead). None for
    any other binary (one given by ADASPEC_LLAMA_SERVER: its build is not known) or CPU."""
    if Path(binary) != server_binary() or not cpu_has_amx():
        return None
    return lambda: ensure_server(variant=NO_AMX)
