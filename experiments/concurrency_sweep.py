"""Concurrency sweep: `adaspec serve` against llama-server with as many slots (issue 33).

For each concurrency C (`--clients 1,2,4,8,16`) and each system (`--systems`), in that order
(the systems alternate inside each concurrency, each repeat starting one system later: the
first server of a repeat ran slower), it starts a fresh server, sends one warm-up request
(a prompt the wave does not use), then one wave: C client threads start together and each
sends `--requests-per-client` streamed chat completions one after another (greedy,
`--max-tokens` new tokens, loopback HTTP). Every request is timed by its client: latency
(request sent to the end of the stream) and time to first token (to the first chunk with
content). The wave's aggregate tokens/s is the sum of the answers' completion tokens over the
wall time of the whole wave. The server is stopped before the next one starts. Right before
each wave a fixed probe (matrix products and an array copy, in a fresh process) reads how
fast the machine is at that minute; the report lists it beside every wave, and with
`--repeats` it also compares `auto` with the fixed methods inside each repeat.

Systems:

- `adaspec:METHOD` -- `adaspec serve --method METHOD --max-batch C --max-queue Q` (the serve
  command of the checkout this script is in: its `src/` goes first on the server's
  PYTHONPATH). A server that does not know `--max-batch` (before continuous batching) is
  started without it at C = 1 (said in the output); at C > 1 the row reports the error.
  `adaspec:fixed` is `adaspec:<--fixed>`.
- `adaspec:METHOD@VAR=VALUE` -- the same with an environment variable set for that server
  (more than one: `@A=1@B=2`), e.g. `adaspec:auto@ADASPEC_IK_AMX=off` for the native build's
  pinned kernels beside its AMX ones in one run.
- `adaspec-fifo:METHOD` -- the same with `--max-batch 1` (one request decoding, the others
  queued), the baseline of issue 33's "today's" targets.
- `llama-server`, `llama-server:spec=TYPE` -- the native llama-server the bench builds
  (`lab.bench.peer_build`), started as the bench starts it (`lab.bench.llama_server`: its
  stock settings, the bench's threads, repacking on) with `-np C` slots and `-c C *
  --ctx-per-slot` (continuous batching is its default). If it crashes, the bench's
  fall-back applies (a native crash with repacking on before any request: on a CPU with AMX,
  restart from llama.cpp built without its AMX kernels, repacking still on; else, or if that
  crashes too, with `--no-repack`); if a speculative type still crashes (at warm-up or in the
  wave), the row is measured with plain llama-server instead and says so.

Prompts: from the bench suites (`lab.bench.suites`), interleaved across suites, at most
`--max-prompt-chars` characters each (ShareGPT has 400 kB ones; HumanEval leaves out the
problems code editing rewrites). A wave at concurrency C uses
the first C * requests-per-client prompts; client i's j-th request is prompt i + C*j, so every
request of a wave has its own prompt and every system gets the same ones. Every server is
fresh (no prompt cache, no history from another wave: adaspec runs with `--history off`
unless `--history` says otherwise).

Outputs under --out: `sweep.json` (every request's figures, the machine, the command line,
each server's settings and fall-backs, server logs' paths) and `sweep.md` (a table per
concurrency). The server's own figures (adaspec's usage.speculation, llama-server's timings)
are kept per request and are labelled server-side: not end to end.

`--soak SECONDS`: instead of the sweep, `--soak-clients` (16) clients against one adaspec
server (`--soak-system`, max-batch = clients) for that long; every `--disconnect-every`-th
request of a client closes its socket after `--disconnect-after` content chunks. It counts
completed, disconnected (on purpose), lost (no complete answer), malformed and failed
(non-200) requests and samples the server's RSS (/proc/PID/status, the process and its
children) every `--rss-every` seconds: after the warm-up (one request per client, all at
once) against the end. Writes `soak.json` and `soak.md`.

The full sweep (about 40 minutes on 2 vCPUs):

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/concurrency_sweep.py \\
        --out experiments/results/concurrency-sweep

(add `--systems` with `adaspec-fifo:auto` to the default list for issue 33's targets against
the FIFO queue, about 5 minutes more; run from a checkout of main for the code before
continuous batching). The soak, 10 minutes:

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/concurrency_sweep.py \\
        --soak 600 --out experiments/results/concurrency-soak

A quick check of the harness against llama-server only:

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/concurrency_sweep.py \\
        --systems llama-server,llama-server:spec=ngram-mod --clients 1,2 \\
        --requests-per-client 1 --max-tokens 16 --out /tmp/sweep-check
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import os
import random
import re
import shlex
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from serve_load import _pct, _rss_kb, _slope_per_minute, _tree  # experiments/serve_load.py

from adaspec.lab.bench.llama_server import (
    HOST,
    SETTLE_S,
    LlamaServer,
    LlamaServerDecoder,
    amx_free_build,
)
from adaspec.lab.bench.peer_build import SERVER, PeerUnavailable

REPO = Path(__file__).resolve().parents[1]
SUITES = "humaneval,codeedit,wmt,sharegpt"
LLAMA_SPECS = ("ngram-simple", "ngram-mod", "ngram-map-k")  # the bench's n-gram types
MAX_CLIENTS, MAX_REQUESTS_PER_CLIENT, MAX_SOAK_S = 64, 100, 4 * 3600
SOAK_DEFAULT_SYSTEM = "adaspec:auto"


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def serve_this_checkout() -> None:
    """Servers started from here run this checkout's adaspec (an editable install may point
    elsewhere): its `src/` first on their PYTHONPATH."""
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])


# ---------------------------------------------------------------------- systems
@dataclass(frozen=True)
class System:
    label: str  # as given: adaspec:auto, llama-server:spec=ngram-mod, ...
    kind: str  # adaspec | adaspec-fifo | llama-server
    method: str = ""  # adaspec's --method
    spec: str = "none"  # llama-server's --spec-type
    env: tuple[tuple[str, str], ...] = ()  # adaspec's server: VAR=VALUE set for its process


def parse_systems(text: str, fixed: str) -> list[System]:
    """Comma-separated systems; a method string's own commas stay with it (a new item starts
    only where `adaspec` or `llama-server` follows a comma)."""
    systems = []
    for item in re.split(r",(?=\s*(?:adaspec|llama-server))", text):
        item = item.strip()
        kind, _, rest = item.partition(":")
        if kind in ("adaspec", "adaspec-fifo"):
            rest, *settings = re.split(r"@(?=[A-Za-z_][A-Za-z0-9_]*=)", rest)
            env = tuple((var, value) for var, _, value in (s.partition("=") for s in settings))
            method = fixed if rest == "fixed" else rest
            if not method:
                raise SystemExit(f"{item!r}: give a method, e.g. adaspec:auto")
            from adaspec.methods.spec import parse_method

            parse_method(method)  # a typo fails before any server starts
            label = f"{kind}:{method}" + "".join(f"@{s}" for s in settings)
            systems.append(System(label, kind, method=method, env=env))
        elif kind == "llama-server":
            spec = rest.partition("spec=")[2] if rest else "none"
            if rest and not rest.startswith("spec="):
                raise SystemExit(f"{item!r}: use llama-server or llama-server:spec=TYPE")
            if spec not in ("none", *LLAMA_SPECS, "ngram-map-k4v"):
                raise SystemExit(f"{item!r}: spec types here: none, {', '.join(LLAMA_SPECS)}, "
                                 "ngram-map-k4v")
            systems.append(System(item if spec != "none" else "llama-server", kind, spec=spec))
        else:
            raise SystemExit(f"unknown system {item!r}: adaspec:METHOD, adaspec-fifo:METHOD, "
                             "llama-server or llama-server:spec=TYPE")
    return systems


def default_systems(fixed: str) -> str:
    return ",".join(["adaspec:auto", "adaspec:ar", f"adaspec:{fixed}", "llama-server",
                     *(f"llama-server:spec={s}" for s in LLAMA_SPECS)])


# ---------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class SweepPrompt:
    id: str
    suite: str
    text: str


def prompt_pool(suites: list[str], needed: int, max_chars: int) -> list[SweepPrompt]:
    """`needed` prompts, one suite after the other in turn (round robin while a suite has
    prompts of at most max_chars characters)."""
    from adaspec.lab.bench.suites import load_suite

    per_suite = [[SweepPrompt(p.id, name, p.text) for p in load_suite(name)
                  if len(p.text) <= max_chars] for name in suites]
    if "codeedit" in suites and "humaneval" in suites:
        # code editing rewrites HumanEval problems (codeedit/HumanEval/0/hints): leave those
        # problems out of humaneval, so no two prompts of a wave share their code
        edited = {p.id.split("/", 1)[1].rsplit("/", 1)[0] for p in per_suite[
            suites.index("codeedit")]}
        per_suite[suites.index("humaneval")] = [
            p for p in per_suite[suites.index("humaneval")] if p.id not in edited]
    pool: list[SweepPrompt] = []
    while len(pool) < needed and any(per_suite):
        for rows in per_suite:
            if rows and len(pool) < needed:
                pool.append(rows.pop(0))
    if len(pool) < needed:
        raise SystemExit(f"only {len(pool)} prompts of at most {max_chars} characters in "
                         f"{suites}; {needed} needed")
    return pool


# ---------------------------------------------------------------------- one request
@dataclass
class Record:
    """One request as its client saw it (times in seconds, from the request being sent)."""

    system: str
    concurrency: int
    client: int
    seq: int
    prompt: str  # the prompt's id
    suite: str
    sent_at: float = 0.0  # seconds after the wave (or the soak) began
    status: int = 0  # HTTP status (0: none)
    outcome: str = "lost"  # ok | failed (not 200, or an error event) | malformed | lost |
    #                       disconnected (the client closed the stream on purpose)
    error: str = ""
    latency: float | None = None  # to the end of the stream ([DONE]), ok requests
    ttft: float | None = None  # to the first chunk with content
    content_chunks: int = 0
    completion_tokens: int = 0  # the server's usage
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    text_chars: int = 0
    text_sha: str = ""  # sha256 of the answer's text, first 12 hex digits (compare outputs)
    server: dict = field(default_factory=dict)  # server-side figures: not end to end


def chat_request(port: int, body: dict, rec: Record, timeout: float,
                 disconnect_after: int | None = None, pieces: list[str] | None = None
                 ) -> Record:
    """POST a streamed chat completion to 127.0.0.1:port and check the answer's protocol:
    `data:` lines of JSON, exactly one finish_reason (stop or length), usage with 0 <
    completion_tokens <= max_tokens, then [DONE] and nothing after it. `pieces`: where the
    answer's text goes, piece by piece (the caller's list)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    pieces = [] if pieces is None else pieces
    finishes: list[str] = []
    usage: dict | None = None
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        rec.status = resp.status
        if resp.status != 200:
            rec.outcome, rec.error = "failed", resp.read()[:300].decode(errors="replace")
            return rec
        done = False
        while True:
            raw = resp.readline()
            if not raw:
                break
            line = raw.strip()
            if not line or line.startswith(b":"):
                continue
            if done:
                return _bad(rec, f"after [DONE]: {line[:80]!r}")
            if line.startswith(b"error:"):
                rec.outcome, rec.error = "failed", line.decode(errors="replace")[:300]
                return rec
            if not line.startswith(b"data:"):
                return _bad(rec, f"not an SSE data line: {line[:80]!r}")
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            event = json.loads(payload)
            if "error" in event:
                rec.outcome, rec.error = "failed", json.dumps(event["error"])[:300]
                return rec
            if event.get("usage"):
                usage = event["usage"]
            if event.get("timings"):  # llama-server's own figures
                rec.server["timings"] = event["timings"]
            choices = event["choices"]
            if not choices:  # stream_options.include_usage's usage-only chunk
                continue
            choice = choices[0]
            text = (choice.get("delta") or {}).get("content")
            if text:
                if rec.ttft is None:
                    rec.ttft = time.perf_counter() - t0
                pieces.append(text)
                rec.content_chunks += 1
                if disconnect_after is not None and rec.content_chunks >= disconnect_after:
                    rec.outcome = "disconnected"
                    with contextlib.suppress(OSError):
                        if conn.sock is not None:
                            conn.sock.shutdown(socket.SHUT_RDWR)
                    return rec
            if choice.get("finish_reason") is not None:
                finishes.append(choice["finish_reason"])
        end = time.perf_counter()
        if not done:
            rec.error = "the stream ended before [DONE]"
            return rec  # lost
        text = "".join(pieces)
        rec.text_chars = len(text)
        rec.text_sha = hashlib.sha256(text.encode()).hexdigest()[:12]
        if finishes not in (["stop"], ["length"]):
            return _bad(rec, f"finish_reason(s) {finishes}")
        rec.finish_reason = finishes[0]
        if usage is None:
            return _bad(rec, "no usage")
        rec.completion_tokens = int(usage.get("completion_tokens", 0))
        rec.prompt_tokens = usage.get("prompt_tokens")
        if usage.get("speculation"):  # adaspec's own figures
            rec.server["speculation"] = usage["speculation"]
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:  # prompt tokens the cache held
            rec.server["cached_tokens"] = details["cached_tokens"]
        if not 0 < rec.completion_tokens <= body["max_tokens"]:
            return _bad(rec, f"completion_tokens {rec.completion_tokens}")
        rec.latency = end - t0
        rec.outcome = "ok"
        return rec
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, IndexError,
            ValueError) as exc:
        return _bad(rec, f"{type(exc).__name__}: {exc}")
    except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out
        rec.outcome, rec.error = "lost", f"{type(exc).__name__}: {exc}"[:300]
        return rec
    finally:
        conn.close()


def _bad(rec: Record, why: str) -> Record:
    rec.outcome, rec.error = "malformed", why[:300]
    return rec


def chat_body(prompt: str, max_tokens: int, model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


# ---------------------------------------------------------------------- servers
class Peer:
    """A started server: its port, process, settings, and how to stop it."""

    port: int
    pid: int
    info: dict

    def alive(self, settle: float = 0.0) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class AdaspecPeer(Peer):
    """`adaspec serve` on a free loopback port, ready when /health answers 200 (started and
    waited for by the bench's LlamaServer, which runs any binary with these arguments)."""

    def __init__(self, binary: Path, args: list[str], log: Path, startup_timeout: float,
                 env: dict[str, str] | None = None):
        try:
            self.server = LlamaServer(binary, args, log, startup_timeout, env=env).start()
        except PeerUnavailable as exc:  # its messages name llama-server
            raise PeerUnavailable(str(exc).replace(SERVER, "adaspec serve")) from None
        assert self.server.proc is not None
        self.port, self.pid = self.server.port, self.server.proc.pid
        self.info = {"binary": str(binary), "args": args, "env": env or {}, "log": str(log),
                     "url": f"http://{HOST}:{self.port}", "health": health(self.port)}

    def alive(self, settle: float = 0.0) -> bool:
        return self.server.exit_code(settle) is None

    def close(self) -> None:
        self.server.close()


class SlotServer(LlamaServerDecoder):
    """The bench's llama-server decoder (its start, its crash fall-backs, its
    description) with `slots` parallel slots: `-np slots`, the context `n_ctx` shared."""

    def __init__(self, slots: int, *args: Any, **kwargs: Any) -> None:
        self.slots = slots
        super().__init__(*args, **kwargs)

    def _args(self) -> list[str]:
        return [*super()._args(), "-np", str(self.slots)]


class LlamaPeer(Peer):
    def __init__(self, decoder: SlotServer) -> None:
        self.decoder = decoder
        self.refresh()

    def refresh(self) -> None:
        server = self.decoder.server
        assert server.proc is not None
        self.port, self.pid = server.port, server.proc.pid
        self.info = self.decoder.describe()

    def alive(self, settle: float = 0.0) -> bool:
        """`settle`: after failed requests, how long a crashing server may take to exit."""
        return self.decoder.server.exit_code(settle) is None

    def close(self) -> None:
        self.decoder.close()


def _get(port: int, path: str) -> bytes | None:
    """The body of GET path on the local server, None when it does not answer."""
    with contextlib.suppress(OSError, http.client.HTTPException):
        conn = http.client.HTTPConnection(HOST, port, timeout=10)
        try:
            conn.request("GET", path)
            return conn.getresponse().read()
        finally:
            conn.close()
    return None


def health(port: int) -> dict:
    with contextlib.suppress(ValueError):
        return json.loads(_get(port, "/health") or b"{}")
    return {}


ROUND_SERIES = ("adaspec_batch_rounds_total", "adaspec_batch_round_seconds_total",
                "adaspec_batch_round_modelled_seconds_total", "adaspec_batch_tokens_total")


def round_counters(port: int) -> dict[str, float]:
    """The server's batched-round counters (`serve/metrics.py`), keyed `name/label`."""
    body = _get(port, "/metrics")
    return parse_round_counters(body.decode()) if body else {}


def parse_round_counters(text: str) -> dict[str, float]:
    """`round_counters` from the Prometheus text of /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f"{s.name}/{next(iter(s.labels.values()))}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in ROUND_SERIES}


def round_split(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """Where a wave's server time went: seconds and rounds of prefill and decode rounds, the
    prompt and step tokens scored (the wave's counters less the warm-up's)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    if not d:
        return None
    sec = {k: round(d.get(f"adaspec_batch_round_seconds_total/{k}", 0.0), 2)
           for k in ("prefill", "decode")}
    rounds = {k: int(d.get(f"adaspec_batch_rounds_total/{k}", 0)) for k in ("prefill", "decode")}
    # the same calls priced by the server's batch cost curve: modelled, not timed
    modelled = {k: round(d.get(f"adaspec_batch_round_modelled_seconds_total/{k}", 0.0), 2)
                for k in ("prefill", "decode")}
    return {"seconds": sec, "rounds": rounds, "modelled_seconds": modelled,
            "prompt_tokens": int(d.get("adaspec_batch_tokens_total/prompt", 0)),
            "step_tokens": int(d.get("adaspec_batch_tokens_total/step", 0)),
            "cut_tokens": int(d.get("adaspec_batch_tokens_total/cut", 0))}


def cpu_seconds(pid: int) -> dict[int | str, float]:
    """CPU seconds (user + system, /proc/PID/stat) of the server and each process under it
    (its runtimes' children), and the machine's time stolen by the hypervisor and idle
    (/proc/stat, all CPUs: "steal", "idle")."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int | str, float] = {}
    for p in _tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[p] = (int(fields[11]) + int(fields[12])) / tick
    with contextlib.suppress(OSError, IndexError, ValueError):
        cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        out["idle"], out["steal"] = int(cpu[4]) / tick, int(cpu[8]) / tick
    return out


def cpu_split(pid: int, before: dict[int | str, float], after: dict[int | str, float]
              ) -> dict:
    """A wave's CPU seconds: the server's own process (HTTP, scheduling, drafting, pricing),
    its runtime children (the models' threads; `children`: each one's, most first), and the
    machine's idle and stolen seconds (a wave slowed by the hypervisor shows it)."""
    used = {p: after[p] - before.get(p, 0.0) for p in after}
    machine = {k: round(used.pop(k, 0.0), 2) for k in ("idle", "steal")}
    server = round(used.pop(pid, 0.0), 2)
    return {"server": server, "runtimes": round(sum(used.values()), 2),
            "children": sorted((round(v, 2) for v in used.values()), reverse=True),
            **machine}


def _log_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


@dataclass
class Context:
    """What every server start needs (from the command line)."""

    out: Path
    adaspec_bin: Path
    adaspec_args: list[str]
    history: str
    target: str
    gguf: Path | None
    llama_bin: Path | None
    threads: int
    ctx_per_slot: int
    request_timeout: float
    startup_timeout: float
    max_tokens: int
    notes: list[str] = field(default_factory=list)

    def log_path(self, system: System, clients: int, extra: str = "") -> Path:
        slug = re.sub(r"[^A-Za-z0-9_.=-]", "_", system.label)
        return self.out / "logs" / f"{slug}-c{clients}{extra}.log"


def start_adaspec(ctx: Context, system: System, clients: int, max_batch: bool
                  ) -> tuple[Peer, dict]:
    """An adaspec server for `clients` clients; PeerUnavailable when it does not start.
    Returns the peer and what was decided about --max-batch."""
    args = ["serve", "--method", system.method, "--max-queue", str(max(16, 2 * clients)),
            "--model-name", "adaspec", "--log-level", "warning", "--history", ctx.history,
            "--timeout", f"{ctx.request_timeout:g}", "--target", ctx.target, *ctx.adaspec_args]
    slots = clients if max_batch else 1
    log = ctx.log_path(system, clients)
    try:
        peer = AdaspecPeer(ctx.adaspec_bin, [*args, "--max-batch", str(slots)], log,
                           ctx.startup_timeout, dict(system.env))
        return peer, {"max_batch": slots if max_batch else None,
                      "max_batch_note": "given" if max_batch else "1 (FIFO system)"}
    except PeerUnavailable as exc:
        text = _log_text(log)
        if not ("unrecognized arguments" in text and "--max-batch" in text):
            raise
        if slots > 1:
            raise PeerUnavailable(
                f"adaspec serve does not know --max-batch (this checkout has no continuous "
                f"batching), so {clients} clients cannot be served {clients} at a time: "
                f"{exc}") from None
    note = ("adaspec serve rejected --max-batch (no continuous batching in this checkout): "
            "started without it, one request at a time, what was asked for")
    ctx.notes.append(f"{system.label} at {clients} client(s): {note}")
    peer = AdaspecPeer(ctx.adaspec_bin, args, ctx.log_path(system, clients, "-nomb"),
                       ctx.startup_timeout, dict(system.env))
    return peer, {"max_batch": None, "max_batch_note": note}


def start_llama(ctx: Context, system: System, clients: int, spec: str, extra: str = ""
                ) -> LlamaPeer:
    if ctx.llama_bin is None or ctx.gguf is None:
        raise PeerUnavailable("llama-server or the target's GGUF is not available")
    return LlamaPeer(SlotServer(
        clients, ctx.llama_bin, spec, ctx.gguf, ctx.threads, ctx.log_path(system, clients, extra),
        n_ctx=clients * ctx.ctx_per_slot, without_amx=amx_free_build(ctx.llama_bin)))


def warm_up(peer: Peer, prompt: SweepPrompt, ctx: Context, system: System, clients: int,
            model: str) -> Record:
    rec = Record(system.label, clients, -1, 0, prompt.id, prompt.suite)
    return chat_request(peer.port, chat_body(prompt.text, ctx.max_tokens, model), rec,
                        ctx.request_timeout)


# ---------------------------------------------------------------------- the machine's speed
# A fixed piece of work timed in a fresh process: float32 matrix products on every core (the
# runtimes' compute) and a large array copy (their memory traffic). On this kind of shared VM
# the same wave reads 5-15% apart from one minute to the next; the probe says how fast the
# machine was right before each wave, so a slow wave can be told from a slow system.
PROBE = """
import json, time
import numpy as np
a = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)
big = np.ones(32 * 2**20, dtype=np.float32)
out = np.empty_like(big)
a @ a; np.copyto(out, big)
best_mm = best_cp = float("inf")
for _ in range(5):
    t = time.perf_counter()
    for _ in range(8):
        a @ a
    best_mm = min(best_mm, time.perf_counter() - t)
    t = time.perf_counter()
    np.copyto(out, big)
    best_cp = min(best_cp, time.perf_counter() - t)
print(json.dumps({"matmul_gflops": round(8 * 2 * 512**3 / best_mm / 1e9, 1),
                  "copy_gbs": round(2 * big.nbytes / best_cp / 1e9, 2)}))
"""


def machine_probe() -> dict | None:
    """The probe's figures (None where it could not run: it never stops a sweep)."""
    import subprocess

    try:
        done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                              timeout=60, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


# ---------------------------------------------------------------------- a wave
def run_wave(peer: Peer, system: System, clients: int, prompts: list[SweepPrompt],
             rpc: int, ctx: Context, model: str) -> tuple[list[Record], float]:
    """C clients start together (a barrier); client i sends prompts i, i+C, ... one after
    another. Returns every request's record and the wave's wall time."""
    began: list[float] = []  # the barrier's action: the clock as every client is released
    barrier = threading.Barrier(clients + 1, action=lambda: began.append(time.perf_counter()))
    records: list[list[Record]] = [[] for _ in range(clients)]
    starts: list[list[float]] = [[] for _ in range(clients)]

    def client(i: int) -> None:
        barrier.wait()
        for j in range(rpc):
            p = prompts[i + clients * j]
            rec = Record(system.label, clients, i, j, p.id, p.suite)
            starts[i].append(time.perf_counter())
            records[i].append(chat_request(peer.port, chat_body(p.text, ctx.max_tokens, model),
                                           rec, ctx.request_timeout))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join()
    t0 = began[0]
    wall = time.perf_counter() - t0
    flat = []
    for recs, ts in zip(records, starts, strict=True):
        for rec, sent in zip(recs, ts, strict=True):
            rec.sent_at = round(sent - t0, 4)
            flat.append(rec)
    return flat, wall


def summarize(records: list[Record], wall: float) -> dict:
    ok = [r for r in records if r.outcome == "ok"]
    latency = [r.latency for r in ok if r.latency is not None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tokens = sum(r.completion_tokens for r in ok)
    decode = [_server_decode_rate(r) for r in ok]
    counts = {k: sum(r.outcome == k for r in records)
              for k in ("ok", "failed", "malformed", "lost", "disconnected")}
    return {
        "requests": len(records), **counts,
        "completion_tokens": tokens, "wall_s": round(wall, 3),
        "agg_tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "latency_p50": _pct(latency, 50), "latency_p95": _pct(latency, 95),
        "ttft_p50": _pct(ttft, 50), "ttft_p95": _pct(ttft, 95),
        # server-side (not end to end): the server's own decode rate per request
        "server_decode_tokens_per_s_p50": _pct([d for d in decode if d is not None], 50),
        "errors": sorted({r.error for r in records if r.outcome not in ("ok", "disconnected")
                          and r.error})[:10],
    }


def _server_decode_rate(rec: Record) -> float | None:
    spec = rec.server.get("speculation") or {}
    if "decode_tokens_per_s" in spec:
        return float(spec["decode_tokens_per_s"])
    timings = rec.server.get("timings") or {}
    if "predicted_per_second" in timings:
        return float(timings["predicted_per_second"])
    return None


# ---------------------------------------------------------------------- one system, one C
def measure(ctx: Context, system: System, clients: int, prompts: list[SweepPrompt],
            warm: SweepPrompt, rpc: int, say: Callable[[str], None]) -> dict:
    """Start the server, warm it up, run the wave, stop the server; a row for sweep.json."""
    row: dict[str, Any] = {"system": system.label, "concurrency": clients, "fallbacks": [],
                           "abandoned": []}
    if system.kind == "llama-server":
        return _measure_llama(ctx, system, clients, prompts, warm, rpc, say, row)
    try:
        peer, decided = start_adaspec(ctx, system, clients, system.kind == "adaspec")
    except PeerUnavailable as exc:
        row["error"] = str(exc)
        say(f"  {system.label} c={clients}: not started: {exc}")
        return row
    row["server"] = {**peer.info, **decided}
    try:
        row["warmup"] = asdict(w := warm_up(peer, warm, ctx, system, clients, "adaspec"))
        if w.outcome != "ok":
            row["error"] = f"warm-up {w.outcome}: {w.error}"
            return row
        row["probe"] = machine_probe()
        before, cpu_before = round_counters(peer.port), cpu_seconds(peer.pid)
        records, wall = run_wave(peer, system, clients, prompts, rpc, ctx, "adaspec")
        cpu = cpu_split(peer.pid, cpu_before, cpu_seconds(peer.pid))
        row["server"]["alive_after"] = peer.alive()
        row["rounds"] = round_split(before, round_counters(peer.port))
        if row["rounds"] is not None:
            row["rounds"]["cpu_seconds"] = cpu
    finally:
        peer.close()
    row.update(summary=summarize(records, wall), requests=[asdict(r) for r in records])
    return row


def _measure_llama(ctx: Context, system: System, clients: int, prompts: list[SweepPrompt],
                   warm: SweepPrompt, rpc: int, say: Callable[[str], None], row: dict) -> dict:
    model = "llama-server"
    spec = system.spec
    attempt = 0
    while True:
        attempt += 1
        try:
            peer = start_llama(ctx, system, clients, spec, "" if attempt == 1 else f"-{attempt}")
        except PeerUnavailable as exc:
            if spec != "none":
                _fall_to_plain(row, spec, f"did not start: {exc}", ctx, system, clients, say)
                spec = "none"
                continue
            row["error"] = str(exc)
            say(f"  {system.label} c={clients}: not started: {exc}")
            return row
        try:
            if peer.decoder.fell_back:  # it crashed while starting with repacking on
                _repack_off(row, peer, f"  {system.label} c={clients}: ", say)
            w = warm_up(peer, warm, ctx, system, clients, model)
            if w.outcome != "ok" and peer.decoder.fall_back():
                # the bench's: a native crash with repacking on, before any request served
                _repack_off(row, peer, f"  {system.label} c={clients}: ", say)
                peer.refresh()
                w = warm_up(peer, warm, ctx, system, clients, model)
            row["warmup"] = asdict(w)
            if w.outcome != "ok":
                if not peer.alive(SETTLE_S) and spec != "none":
                    _fall_to_plain(row, spec, f"crashed at warm-up: {w.error}; "
                                   f"{_dead(peer)}", ctx, system, clients, say)
                    spec = "none"
                    continue
                row["error"] = f"warm-up {w.outcome}: {w.error}"
                return row
            peer.decoder._served += 1
            row["probe"] = machine_probe()
            records, wall = run_wave(peer, system, clients, prompts, rpc, ctx, model)
            alive = peer.alive(SETTLE_S if any(r.outcome != "ok" for r in records) else 0.0)
            if not alive and spec != "none":
                row["abandoned"].append({"spec": spec, "summary": summarize(records, wall),
                                         "requests": [asdict(r) for r in records]})
                _fall_to_plain(row, spec, f"crashed during the wave: {_dead(peer)}", ctx, system,
                               clients, say)
                spec = "none"
                continue
            row["server"] = {**peer.info, "slots": clients, "spec_run": spec,
                             "alive_after": alive}
        finally:
            peer.close()
        row.update(summary=summarize(records, wall), requests=[asdict(r) for r in records])
        return row


def _repack_off(row: dict, peer: LlamaPeer, prefix: str, say: Callable[[str], None]) -> None:
    """Record (and say) how the server runs after a crash with repacking on: built without
    AMX kernels, or repacking off."""
    row["fallbacks"].append({"what": "repack", **peer.decoder.repack_choice.as_dict()})
    say(prefix + peer.decoder.repack_choice.reason)


def _dead(peer: LlamaPeer) -> str:
    try:
        peer.decoder.server.check_alive(SETTLE_S)
    except PeerUnavailable as exc:
        return str(exc)
    return "the server still runs"


def _fall_to_plain(row: dict, spec: str, why: str, ctx: Context, system: System, clients: int,
                   say: Callable[[str], None]) -> None:
    note = f"llama-server --spec-type {spec} {why}; measured plain llama-server instead"
    row["fallbacks"].append({"what": "spec", "from": spec, "to": "none", "reason": note})
    ctx.notes.append(f"{system.label} at {clients} client{'s' if clients > 1 else ''}: {note}")
    say(f"  {system.label} c={clients}: {note}")


# ---------------------------------------------------------------------- report
def _f(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def combined(run: dict) -> list[dict]:
    """One row per (system, concurrency) over its repeats: agg tok/s is the median of the
    repeats' (with their range); latency and TTFT percentiles and counts pool the requests."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in run["rows"]:
        groups.setdefault((r["system"], r["concurrency"]), []).append(r)
    out = []
    for (system, c), rows in groups.items():
        done = [r for r in rows if "summary" in r]
        row: dict[str, Any] = {
            "system": system, "concurrency": c, "repeats": len(rows), "measured": len(done),
            "fallbacks": [f for r in rows for f in r.get("fallbacks", [])],
            "server": next((r["server"] for r in done), rows[0].get("server") or {}),
            "errors": [r["error"] for r in rows if "error" in r]}
        if done:
            records = [Record(**q) for r in done for q in r["requests"]]
            rates = [r["summary"]["agg_tokens_per_s"] or 0.0 for r in done]
            m = summarize(records, sum(r["summary"]["wall_s"] for r in done))
            m["agg_tokens_per_s"] = round(statistics.median(rates), 2)
            m["agg_tokens_per_s_range"] = [min(rates), max(rates)]
            row["summary"] = m
            splits = [r["rounds"] for r in done if r.get("rounds")]
            if splits:
                row["rounds"] = _sum_splits(splits)
        out.append(row)
    return out


def _sum_splits(splits: list[dict]) -> dict:
    total: dict = {"seconds": {}, "rounds": {}, "modelled_seconds": {}, "cpu_seconds": {}}
    for s in splits:
        for part in ("seconds", "rounds", "modelled_seconds", "cpu_seconds"):
            for k, v in s.get(part, {}).items():
                if isinstance(v, (int, float)):  # (each child's CPU stays per wave)
                    total[part][k] = round(total[part].get(k, 0) + v, 2)
        for k in ("prompt_tokens", "step_tokens", "cut_tokens"):
            total[k] = total.get(k, 0) + s[k]
    return total


def rounds_md(run: dict) -> list[str]:
    """adaspec's own account of its waves (`/metrics`, summed over the repeats): seconds in
    rounds that carried prompt chunks and in decode-only rounds."""
    rows = [r for r in combined(run) if r.get("rounds")]
    if not rows:
        return []
    lines = ["## Where adaspec's server time went (its /metrics, summed over the repeats)", "",
             "Prefill rounds carry prompt chunks (and the other requests' steps ride along); "
             "decode rounds carry steps only. Step tokens = each request's token per round "
             "plus the drafts verified; cut = drafts the batch pricing left out. Decode "
             "rounds modelled = the same calls priced by the server's batch cost curve "
             "(**modelled, not timed**: the machine's drift does not move it, so systems "
             "compare by the calls they chose). CPU = the wave's CPU seconds of the server's "
             "own process (HTTP, scheduling, drafting, pricing) and of its runtime children "
             "(the models' threads), and the seconds the hypervisor took from this machine's "
             "CPUs meanwhile (stolen), from /proc.", "",
             "| system | clients | prefill rounds (s) | decode rounds (s) | decode rounds "
             "modelled (s) | prefill share | prompt tokens | step tokens | cut | CPU server / "
             "runtimes / stolen (s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        s = r["rounds"]
        pre, dec = s["seconds"].get("prefill", 0.0), s["seconds"].get("decode", 0.0)
        share = pre / (pre + dec) if pre + dec else None
        modelled = s.get("modelled_seconds", {}).get("decode")
        cpu = s.get("cpu_seconds", {})
        lines.append(f"| {r['system']} | {r['concurrency']} | {pre:.1f} "
                     f"({s['rounds'].get('prefill', 0)}) | {dec:.1f} "
                     f"({s['rounds'].get('decode', 0)}) | {_f(modelled)} | {_f(share)} | "
                     f"{s['prompt_tokens']} | "
                     f"{s['step_tokens']} | {s['cut_tokens']} | "
                     f"{_f(cpu.get('server'), 1)} / {_f(cpu.get('runtimes'), 1)} / "
                     f"{_f(cpu.get('steal'), 1)} |")
    return [*lines, ""]


def sweep_md(run: dict) -> str:
    s = run["settings"]
    lines = [
        "# Concurrency sweep: adaspec serve and llama-server",
        "",
        f"{run['date']}; {run['machine'].get('cpu')} ({run['machine'].get('cores')} CPUs); "
        f"target `{s['target']}`; {s['max_tokens']} new tokens, greedy, streamed chat "
        f"completions over loopback HTTP; {s['requests_per_client']} requests per client, "
        f"prompts from {s['suites']} (at most {s['max_prompt_chars']} characters).",
        "",
        f"Command: `{run['command']}`",
        "",
        "End to end, at the client: agg tok/s = completion tokens of the wave's answers / the "
        "wave's wall time (all clients start together); latency = request sent to [DONE]; "
        "TTFT = to the first chunk with content. Each row is a fresh server after one warm-up "
        "request. `vs best llama-server` = agg tok/s / the best llama-server row at that "
        "concurrency. `server decode tok/s` is the server's own figure (adaspec's "
        "usage.speculation, llama-server's timings): not end to end. Failures: failed (not "
        "200) / malformed / lost.",
        "",
    ]
    for c in s["clients"]:
        rows = [r for r in combined(run) if r["concurrency"] == c]
        best = max((r["summary"]["agg_tokens_per_s"] or 0.0 for r in rows
                    if r["system"].startswith("llama-server") and "summary" in r), default=0.0)
        lines += [f"## {c} client{'s' if c > 1 else ''}", "",
                  "| system | agg tok/s | vs best llama-server | p50 latency (s) | "
                  "p95 latency (s) | p50 TTFT (s) | p95 TTFT (s) | failures | ok | "
                  "server decode tok/s p50 (not e2e) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            label = r["system"] + _row_marks(r)
            if "summary" not in r:
                error = str((r["errors"] or ["?"])[0])[:200].replace("|", "/")
                lines.append(f"| {label} | error: {error} | | | | | | | | |")
                continue
            m = r["summary"]
            ratio = m["agg_tokens_per_s"] / best if best and m["agg_tokens_per_s"] else None
            spread = m["agg_tokens_per_s_range"]
            agg = _f(m["agg_tokens_per_s"], 1) + (
                f" ({spread[0]:.1f}-{spread[1]:.1f})" if r["measured"] > 1 else "")
            lines.append(
                f"| {label} | {agg} | {_f(ratio)} | "
                f"{_f(m['latency_p50'])} | {_f(m['latency_p95'])} | {_f(m['ttft_p50'])} | "
                f"{_f(m['ttft_p95'])} | {m['failed']}/{m['malformed']}/{m['lost']} | "
                f"{m['ok']}/{m['requests']} | {_f(m['server_decode_tokens_per_s_p50'], 1)} |")
        lines.append("")
    lines += targets_md(run)
    lines += rounds_md(run)
    lines += waves_md(run)
    if run["notes"]:
        lines += ["## Notes", "", *(f"- {n}" for n in run["notes"]), ""]
    return "\n".join(lines)


def _row_marks(r: dict) -> str:
    marks = []
    falls = r.get("fallbacks", [])
    if any(fb["what"] == "spec" for fb in falls):
        marks.append("fell back to plain")
    repacks = [fb for fb in falls if fb["what"] == "repack"]
    if repacks:  # the last says how it ran: built without AMX (repacking on), or --no-repack
        marks.append("built without AMX" if repacks[-1]["repack"] else "--no-repack")
    if 0 < r["measured"] < r["repeats"]:
        marks.append(f"{r['repeats'] - r['measured']} of {r['repeats']} repeats failed")
    server = r.get("server") or {}
    if r["system"].startswith("adaspec:") and server.get("max_batch") is None and server:
        marks.append("no --max-batch")
    return f" ({'; '.join(marks)})" if marks else ""


def targets_md(run: dict) -> list[str]:
    """Issue 33's targets, where the rows allow them (a number, not a verdict on its own)."""
    rate: dict[tuple[str, int], float] = {}
    ttft95: dict[tuple[str, int], float] = {}
    modelled: dict[tuple[str, int], float] = {}  # decode rounds priced by the curve (s)
    for r in combined(run):
        dec = (r.get("rounds") or {}).get("modelled_seconds", {}).get("decode")
        if dec:
            modelled[(r["system"], r["concurrency"])] = dec
        m = r.get("summary")
        if m and m["agg_tokens_per_s"] and not any(f["what"] == "spec" for f in r["fallbacks"]):
            rate[(r["system"], r["concurrency"])] = m["agg_tokens_per_s"]
            if m["ttft_p95"] is not None:
                ttft95[(r["system"], r["concurrency"])] = m["ttft_p95"]
    fixed = run["settings"]["fixed"]
    lines = ["## Issue 33's targets (from the rows above)", ""]
    for c in run["settings"]["clients"]:
        ada = [v for (s, cc), v in rate.items() if cc == c and s.startswith("adaspec:")]
        peer = [v for (s, cc), v in rate.items() if cc == c and s.startswith("llama-server")]
        auto, ar, fx = (rate.get((f"adaspec:{m}", c)) for m in ("auto", "ar", fixed))
        parts = []
        if ada and peer:
            parts.append(f"best adaspec / best llama-server {max(ada) / max(peer):.2f}"
                         + (" (target >= 2.0)" if c == 8 else ""))
        if auto and (ar or fx):
            floor = max(v for v in (ar, fx) if v)
            parts.append(f"auto / max(ar, {fixed}) {auto / floor:.3f} (target >= 0.97)")
        paired = paired_ratios(run, c)
        if len(paired) > 1:
            parts.append(f"paired by repeat, median of auto / max(ar, {fixed}) "
                         f"{statistics.median(paired):.3f} "
                         f"({', '.join(f'{v:.3f}' for v in paired)})")
        m_auto = modelled.get(("adaspec:auto", c))
        m_floor = [v for v in (modelled.get((f"adaspec:{m}", c)) for m in ("ar", fixed)) if v]
        if m_auto and m_floor:
            parts.append(f"decode rounds modelled, min(ar, {fixed}) / auto "
                         f"{min(m_floor) / m_auto:.3f} (modelled, not timed)")
        fifo = rate.get(("adaspec-fifo:auto", c))
        if c == 1 and auto and fifo:
            parts.append(f"auto / adaspec-fifo:auto {auto / fifo:.3f} (target >= 0.97)")
        t_auto, t_fifo = ttft95.get(("adaspec:auto", c)), ttft95.get(("adaspec-fifo:auto", c))
        if c == 8 and t_auto and t_fifo:
            parts.append(f"p95 TTFT auto / adaspec-fifo:auto {t_auto / t_fifo:.2f} "
                         "(target <= 0.5)")
        if parts:
            lines.append(f"- {c} client{'s' if c > 1 else ''}: " + "; ".join(parts))
    if len(lines) == 2:
        lines.append("- none computable from these rows")
    if not any(s.startswith("adaspec-fifo:auto") for s, _ in rate):
        lines.append("- the targets against today's FIFO queue need `adaspec-fifo:auto` in "
                     "--systems")
    return [*lines, ""]


def paired_ratios(run: dict, clients: int) -> list[float]:
    """auto / max(ar, the fixed method) within each repeat at `clients`, where all three
    were measured: the waves of one repeat run back to back, so the machine's slower and
    faster minutes (the probe) move them alike more often than waves repeats apart."""
    fixed = run["settings"]["fixed"]
    by: dict[int, dict[str, float]] = {}
    for r in run["rows"]:
        rate = (r.get("summary") or {}).get("agg_tokens_per_s")
        if r["concurrency"] == clients and rate:
            by.setdefault(r.get("repeat", 0), {})[r["system"]] = rate
    out = []
    for k in sorted(by):
        got = by[k]
        auto, ar, fx = (got.get(f"adaspec:{m}") for m in ("auto", "ar", fixed))
        if auto and ar and fx:
            out.append(auto / max(ar, fx))
    return out


def waves_md(run: dict) -> list[str]:
    """Every wave in the order it ran, with the machine's speed just before it."""
    rows = [r for r in run["rows"] if r.get("probe") is not None]
    if not rows:
        return []
    lines = ["## The waves in the order they ran, with the machine's speed before each", "",
             "Probe: float32 matrix products on every core and a 128 MB array copy, timed "
             "in a fresh process right before the wave (the best of five; the server idle). "
             "It is not used to adjust any figure above.", "",
             "| clients | repeat | system | agg tok/s | probe GFLOP/s | probe copy GB/s |",
             "| ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        rate = (r.get("summary") or {}).get("agg_tokens_per_s")
        probe = r["probe"]
        lines.append(f"| {r['concurrency']} | {r.get('repeat', 0) + 1} | {r['system']} | "
                     f"{_f(rate, 1)} | {_f(probe.get('matmul_gflops'), 1)} | "
                     f"{_f(probe.get('copy_gbs'), 2)} |")
    return [*lines, ""]


# ---------------------------------------------------------------------- soak
def soak(ctx: Context, system: System, clients: int, seconds: float, pool: list[SweepPrompt],
         every: int, after: int, rss_every: float, seed: int, say: Callable[[str], None]
         ) -> dict:
    if system.kind not in ("adaspec", "adaspec-fifo"):
        raise SystemExit("--soak runs against an adaspec server: --soak-system adaspec:METHOD")
    peer, decided = start_adaspec(ctx, system, clients, system.kind == "adaspec")
    say(f"soak: {system.label} at {peer.info['url']}, {clients} clients, {seconds:g} s")
    rng = random.Random(seed)
    order = [rng.randrange(len(pool)) for _ in range(100_000)]
    lock = threading.Lock()
    records: list[Record] = []
    rss: list[tuple[float, float, float]] = []  # (seconds in, tree MB, process MB)
    count = 0

    def sample(t0: float) -> None:
        rss.append((round(time.perf_counter() - t0, 2),
                    round(sum(_rss_kb(p) for p in _tree(peer.pid)) / 1024, 1),
                    round(_rss_kb(peer.pid) / 1024, 1)))

    try:
        cold = sum(_rss_kb(p) for p in _tree(peer.pid)) / 1024
        warm, warm_wall = run_wave(peer, system, clients, pool, 1, ctx, "adaspec")
        say(f"soak: warm-up {summarize(warm, warm_wall)}")
        t0 = time.perf_counter()
        end = t0 + seconds
        sample(t0)

        def client(i: int) -> None:
            nonlocal count
            n = 0
            while time.perf_counter() < end:
                with lock:
                    p = pool[order[count % len(order)]]
                    count += 1
                cut = after if (n + i) % every == every - 1 else None
                rec = Record(system.label, clients, i, n, p.id, p.suite,
                             sent_at=round(time.perf_counter() - t0, 3))
                rec = chat_request(peer.port, chat_body(p.text, ctx.max_tokens, "adaspec"), rec,
                                   ctx.request_timeout, disconnect_after=cut)
                with lock:
                    records.append(rec)
                n += 1

        def sampler() -> None:
            while time.perf_counter() < end:
                time.sleep(min(rss_every, max(0.0, end - time.perf_counter())))
                sample(t0)

        threads = [threading.Thread(target=client, args=(i,), daemon=True)
                   for i in range(clients)]
        threading.Thread(target=sampler, daemon=True).start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        sample(t0)
        alive, final_health = peer.alive(), health(peer.port)
    finally:
        peer.close()
    summary = summarize(records, wall)
    tree = [r[1] for r in rss]
    half = len(rss) // 2
    return {
        "system": system.label, "clients": clients, "seconds": seconds,
        "disconnect_every": every, "disconnect_after_chunks": after,
        "server": {**peer.info, **decided, "alive_at_end": alive,
                   "health_at_end": final_health},
        "summary": summary,
        "rss_mb": {"cold": round(cold, 1), "after_warmup": tree[0], "end": tree[-1],
                   "max": max(tree), "growth": round(tree[-1] - tree[0], 1),
                   "slope_mb_per_min_second_half": _slope_per_minute(
                       [r[0] for r in rss[half:]], tree[half:]),
                   "parts": {name: _part([(r[0], value(r)) for r in rss]) for name, value in
                             (("process", lambda r: r[2]), ("children", lambda r: r[1] - r[2]))},
                   "series": rss},
        "warmup": [asdict(r) for r in warm],
        "requests": [asdict(r) for r in records],
    }


def _part(series: list[tuple[float, float]]) -> dict:
    """One part of the server's RSS over a soak: after the warm-up, at the end, and the slope
    over the second half."""
    half = len(series) // 2
    return {"after_warmup": round(series[0][1], 1), "end": round(series[-1][1], 1),
            "slope_mb_per_min_second_half": _slope_per_minute(
                [t for t, _ in series[half:]], [v for _, v in series[half:]])}


def soak_md(run: dict) -> str:
    s, m, rss = run["soak"], run["soak"]["summary"], run["soak"]["rss_mb"]
    return "\n".join([
        f"# Soak: {s['system']}, {s['clients']} clients for {s['seconds']:g} s",
        "",
        f"{run['date']}; {run['machine'].get('cpu')} ({run['machine'].get('cores')} CPUs); "
        f"{run['settings']['max_tokens']} new tokens, greedy, streamed chat completions over "
        f"loopback; one request in {s['disconnect_every']} of each client closes its socket "
        f"after {s['disconnect_after_chunks']} content chunks.",
        "",
        f"Command: `{run['command']}`",
        "",
        "| requests | ok | disconnected (on purpose) | lost | malformed | failed (not 200) | "
        "tok/s (all clients, end to end) | p50 / p95 latency (s) | p50 / p95 TTFT (s) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {m['requests']} | {m['ok']} | {m['disconnected']} | {m['lost']} | "
        f"{m['malformed']} | {m['failed']} | {_f(m['agg_tokens_per_s'], 1)} | "
        f"{_f(m['latency_p50'])} / {_f(m['latency_p95'])} | {_f(m['ttft_p50'])} / "
        f"{_f(m['ttft_p95'])} |",
        "",
        f"Server RSS (process and children, /proc/PID/status): {rss['cold']} MB before any "
        f"request, {rss['after_warmup']} MB after the warm-up ({s['clients']} requests at "
        f"once), {rss['end']} MB at the end ({rss['growth']:+} MB), {rss['max']} MB at most; "
        f"slope over the second half {rss['slope_mb_per_min_second_half']} MB/min.",
        *[f"- {name}: {p['after_warmup']} MB after the warm-up, {p['end']} at the end, "
          f"{p['slope_mb_per_min_second_half']} MB/min over the second half"
          + (" (the server's own: HTTP, scheduling, drafting, the history)"
             if name == "process" else " (the runtimes: weights, KV caches, buffers)")
          for name, p in rss.get("parts", {}).items()],
        *([f"- the history at the end (a cache that grows to its budget, then holds): "
           f"{h['tokens']:,} tokens of {h['documents']:,} requests, budget {h['budget']:,}"]
          if (h := s['server']['health_at_end'].get('history')) else []),
        f"The server at the end: {'running' if s['server']['alive_at_end'] else 'DEAD'}, "
        f"/health {s['server']['health_at_end'].get('status', 'no answer')}.",
        "",
        *(["Errors: " + "; ".join(f"`{e}`" for e in m["errors"]), ""] if m["errors"] else []),
        *([f"- {n}" for n in run["notes"]] + [""] if run["notes"] else []),
    ])


# ---------------------------------------------------------------------- main
def wave_order(systems: list[System], repeats: int, step: int) -> list[tuple[int, System]]:
    """(repeat, system) in the order a concurrency's waves run: every system once a repeat,
    the rotation starting one system later each repeat and each concurrency (`step`, its
    index), so no system is always the first server after another one's (a llama-server's).
    Whether the first server reads slower is not established (session 28's two one-run
    sweeps ran `auto` first at every concurrency: 1.005 and 0.933 of the better fixed method
    at 4 clients, 1.019 and 0.969 at 8); the rotation keeps any such bias off one system."""
    n = len(systems)
    return [(k, systems[(k + step + i) % n]) for k in range(repeats) for i in range(n)]


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--clients", default="1,2,4,8,16", help="concurrencies (default 1,2,4,8,16)")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated (default {default_systems('FIXED')})")
    p.add_argument("--fixed", default="ngram:k=4",
                   help="adaspec's fixed-draft-length method (default ngram:k=4)")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1,
                   help="waves per system and concurrency, each on a fresh server, the "
                        "systems alternating, each repeat starting one system later "
                        "(default 1); the table gives the median")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--suites", default=SUITES)
    p.add_argument("--max-prompt-chars", type=int, default=2000)
    p.add_argument("--ctx-per-slot", type=int, default=2048,
                   help="llama-server: context tokens per slot (-c = slots * this)")
    p.add_argument("--threads", type=int, default=None,
                   help="llama-server's -t/-tb (default: the bench's, every usable core)")
    p.add_argument("--target", default=None, help="default: the built-in target")
    p.add_argument("--adaspec-bin", default=None,
                   help="default: the adaspec next to this Python (.venv/bin/adaspec)")
    p.add_argument("--adaspec-args", default="", help="more `adaspec serve` arguments")
    p.add_argument("--history", default="off",
                   help="adaspec serve --history (default off: no history from other runs)")
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--soak", type=float, default=0.0, metavar="SECONDS")
    p.add_argument("--soak-system", default=SOAK_DEFAULT_SYSTEM)
    p.add_argument("--soak-clients", type=int, default=16)
    p.add_argument("--disconnect-every", type=int, default=4)
    p.add_argument("--disconnect-after", type=int, default=2, help="content chunks")
    p.add_argument("--rss-every", type=float, default=5.0, help="seconds")
    p.add_argument("--seed", type=int, default=0, help="the soak's prompt order")
    p.add_argument("--out", default="experiments/results/concurrency-sweep")
    args = p.parse_args()

    clients = [int(c) for c in args.clients.split(",") if c.strip()]
    rpc = args.requests_per_client
    if not (clients and all(1 <= c <= MAX_CLIENTS for c in clients)
            and 1 <= rpc <= MAX_REQUESTS_PER_CLIENT and 1 <= args.max_tokens <= 4096
            and 0 <= args.soak <= MAX_SOAK_S and 1 <= args.soak_clients <= MAX_CLIENTS
            and args.disconnect_every >= 1 and args.disconnect_after >= 1
            and 1 <= args.repeats <= 10):
        raise SystemExit(f"bounds: 1 <= clients <= {MAX_CLIENTS}, 1 <= requests-per-client "
                         f"<= {MAX_REQUESTS_PER_CLIENT}, 1 <= max-tokens <= 4096, 0 <= soak "
                         f"<= {MAX_SOAK_S} s, disconnect-every and -after >= 1, 1 <= repeats <= 10")
    from adaspec.store.catalog import TARGET_DEFAULT

    target = args.target or TARGET_DEFAULT
    systems = parse_systems(args.systems or default_systems(args.fixed), args.fixed)
    if args.soak:
        systems = parse_systems(args.soak_system, args.fixed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    serve_this_checkout()
    gguf = llama_bin = None
    notes: list[str] = []
    if any(s.kind == "llama-server" for s in systems):
        from adaspec.backends.gguf import gguf_file
        from adaspec.lab.bench.peer_build import ensure_server

        gguf = gguf_file(target)
        env_bin = os.environ.get("ADASPEC_LLAMA_SERVER")
        try:
            llama_bin = Path(env_bin) if env_bin else ensure_server(log=say)
        except PeerUnavailable as exc:
            notes.append(f"llama-server unavailable: {exc}")
    from adaspec.backends.weights import llama_threads

    ctx = Context(
        out=out, adaspec_bin=Path(args.adaspec_bin or Path(sys.executable).parent / "adaspec"),
        adaspec_args=shlex.split(args.adaspec_args), history=args.history, target=target,
        gguf=gguf, llama_bin=llama_bin, threads=args.threads or llama_threads(),
        ctx_per_slot=args.ctx_per_slot, request_timeout=args.request_timeout,
        startup_timeout=args.startup_timeout, max_tokens=args.max_tokens, notes=notes)
    suites = args.suites.split(",")
    from adaspec.lab.bench.machine import describe_machine

    run: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "machine": describe_machine(),
        "settings": {
            "clients": clients, "systems": [s.label for s in systems], "fixed": args.fixed,
            "requests_per_client": rpc, "repeats": args.repeats,
            "max_tokens": args.max_tokens, "suites": suites,
            "max_prompt_chars": args.max_prompt_chars, "target": target,
            "gguf": str(gguf) if gguf else None,
            "llama_server": str(llama_bin) if llama_bin else None,
            "llama_threads": ctx.threads, "ctx_per_slot": args.ctx_per_slot,
            "adaspec_bin": str(ctx.adaspec_bin), "adaspec_src": str(REPO / "src"),
            "adaspec_args": ctx.adaspec_args, "history": args.history,
            "request_timeout": args.request_timeout, "temperature": 0.0, "stream": True,
            "endpoint": "/v1/chat/completions", "harness_pid": os.getpid(),
        },
        "notes": notes,
    }
    if args.soak:
        pool = prompt_pool(suites, max(64, args.soak_clients), args.max_prompt_chars)
        try:
            run["soak"] = soak(ctx, systems[0], args.soak_clients, args.soak, pool,
                               args.disconnect_every, args.disconnect_after, args.rss_every,
                               args.seed, say)
        except PeerUnavailable as exc:
            raise SystemExit(f"soak: the server did not start: {exc}") from None
        (out / "soak.json").write_text(json.dumps(run))
        (out / "soak.md").write_text(soak_md(run))
        print(soak_md(run))
        return 0

    pool = prompt_pool(suites, max(clients) * rpc + 1, args.max_prompt_chars)
    warm, prompts = pool[-1], pool[:-1]
    run["prompts"] = [{"id": q.id, "suite": q.suite, "chars": len(q.text)} for q in pool]
    run["warmup_prompt"] = warm.id
    run["rows"] = []
    try:
        for ci, c in enumerate(clients):
            for position, (k, system) in enumerate(wave_order(systems, args.repeats, ci)):
                say(f"{system.label}: {c} client(s) x {rpc} request(s)"
                    + (f", repeat {k + 1}/{args.repeats}" if args.repeats > 1 else ""))
                row = measure(ctx, system, c, prompts, warm, rpc, say)
                run["rows"].append({"repeat": k, "position": position, **row})
                if "summary" in row:
                    m = row["summary"]
                    say(f"  {m['agg_tokens_per_s']} tok/s, latency p50 {m['latency_p50']} s, "
                        f"TTFT p50 {m['ttft_p50']} s, ok {m['ok']}/{m['requests']}")
                (out / "sweep.json").write_text(json.dumps(run))  # after each row
    finally:
        run["combined"] = combined(run)  # the table's rows (no per-request figures)
        (out / "sweep.json").write_text(json.dumps(run))
        (out / "sweep.md").write_text(sweep_md(run))
    print(sweep_md(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
