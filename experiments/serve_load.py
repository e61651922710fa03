"""Load test of `adaspec serve`, loopback only, bounded in time and in requests.

It starts `adaspec serve` on 127.0.0.1 in a subprocess, then:

1. load: N client threads send random bench prompts (Spec-Bench, HumanEval, code editing)
   for T minutes (or until --max-requests), a mix of streaming and not; it counts requests
   sent / completed / failed / rejected (429) / malformed, and reports p50/p95 time to first
   token and tokens/s, and the server's RSS (its process tree) at start and end;
2. overhead: the same greedy requests one at a time through HTTP, then (server stopped)
   through the library in this process: tokens/s of each, and whether the texts match.

It writes `summary.md` and `run.json` under --out. The real measurement (8 clients, 10
minutes, the built-in pair):

    .venv/bin/python experiments/serve_load.py --clients 8 --minutes 10 \
        --out experiments/results/serve-load-epyc

A quick check of the script on random tiny models (a few seconds of load):

    .venv/bin/python experiments/serve_load.py --tiny --clients 3 --minutes 0.2 \
        --overhead-requests 4 --out /tmp/serve-load-tiny
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
MAX_MINUTES, MAX_CLIENTS, MAX_REQUESTS = 60.0, 64, 100_000


# ---------------------------------------------------------------------- prompts
def bench_prompts(suites: list[str], per_category: int) -> list[str]:
    from adaspec.lab.bench.suites import load_suite

    prompts: list[str] = []
    for name in suites:
        prompts += [p.text for p in load_suite(name, limit=per_category)]
    if not prompts:
        raise SystemExit("no prompts loaded")
    return prompts


# ---------------------------------------------------------------------- the server
class Server:
    """`adaspec serve` in a subprocess on a free loopback port."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "adaspec", "serve", "--host", "127.0.0.1", "--port", "0",
             "--log-level", "warning", *argv],
            stderr=subprocess.PIPE, stdout=self.log, text=True, env=env, cwd=REPO)
        self.url = ""
        deadline = time.monotonic() + 900  # the first run may measure a cost profile
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.write(line)
            if "listening on" in line:
                self.url = line.split("listening on ")[1].split()[0]
                break
            if time.monotonic() > deadline:
                break
        if not self.url:
            self.stop()
            raise SystemExit(f"the server did not start; see {log}")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.write(line)

    def rss_mb(self) -> float:
        """Resident memory of the server and its child processes (llama.cpp runtimes)."""
        return sum(_rss_kb(pid) for pid in _tree(self.proc.pid)) / 1024

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        return self.proc.wait()


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in task.read_text().split()]
    return pids


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# ---------------------------------------------------------------------- one request
@dataclass
class Outcome:
    stream: bool
    status: int = 0
    ok: bool = False
    malformed: str = ""  # what was wrong with a 200 answer
    error: str = ""
    latency: float = 0.0  # client-side, whole request
    ttft: float | None = None  # client-side, streaming only: first content chunk
    server_ttft: float | None = None  # queue + prefill, from usage.speculation
    tokens: int = 0
    text: str = ""
    decode_tokens_per_s: float | None = None


def request(client: httpx.Client, url: str, prompt: str, max_tokens: int, stream: bool,
            temperature: float, model: str) -> Outcome:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": temperature, "stream": stream}
    out = Outcome(stream)
    t0 = time.perf_counter()
    try:
        if stream:
            _stream(client, url, body, out, t0)
        else:
            r = client.post(url + "/v1/chat/completions", json=body)
            out.status = r.status_code
            if r.status_code == 200:
                _check_completion(r.json(), out, max_tokens)
            else:
                out.error = r.text[:200]
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
        if isinstance(exc, (json.JSONDecodeError, KeyError, TypeError, ValueError)):
            out.malformed = out.error
    out.latency = time.perf_counter() - t0
    out.ok = out.status == 200 and not out.malformed and not out.error
    return out


def _check_completion(body: dict, out: Outcome, max_tokens: int) -> None:
    choice = body["choices"][0]
    text, finish = choice["message"]["content"], choice["finish_reason"]
    usage = body["usage"]
    if not isinstance(text, str) or finish not in ("stop", "length"):
        out.malformed = f"bad choice {choice!r:.100}"
    elif not 0 < usage["completion_tokens"] <= max_tokens:
        out.malformed = f"completion_tokens {usage['completion_tokens']}"
    _usage(usage, out)
    out.text = text


def _usage(usage: dict, out: Outcome) -> None:
    out.tokens = int(usage["completion_tokens"])
    spec = usage.get("speculation") or {}
    if spec:
        out.server_ttft = spec["queue_time"] + spec["time_to_first_token"]
        out.decode_tokens_per_s = spec["decode_tokens_per_s"]


def _stream(client: httpx.Client, url: str, body: dict, out: Outcome, t0: float) -> None:
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.error = r.read().decode()[:200]
            return
        pieces, finishes, done, usage = [], [], False, None
        for line in r.iter_lines():
            if not line:
                continue
            if not line.startswith("data: ") or done:
                out.malformed = f"bad SSE line {line[:80]!r}"
                return
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                out.error = str(chunk["error"].get("message"))[:200]
                return
            choice = chunk["choices"][0]
            text = choice["delta"].get("content")
            if text:
                if out.ttft is None:
                    out.ttft = time.perf_counter() - t0
                pieces.append(text)
            if choice["finish_reason"] is not None:
                finishes.append(choice["finish_reason"])
                usage = chunk.get("usage")
        if not done or len(finishes) != 1 or usage is None:
            out.malformed = f"stream ended badly (done={done}, finishes={finishes})"
            return
        _usage(usage, out)
        out.text = "".join(pieces)


# ---------------------------------------------------------------------- phases
def load_phase(url: str, model: str, prompts: list[str], clients: int, seconds: float,
               max_requests: int, max_tokens: int, stream_share: float, seed: int,
               server: Server) -> dict:
    rng_lock = threading.Lock()
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    sent = 0
    rss_cold = server.rss_mb()
    # warm-up before the baseline: the first requests of each kind build engine state,
    # profile caches and allocator pools once; growth after them is what a leak looks like
    with httpx.Client(timeout=httpx.Timeout(900.0, connect=10.0)) as client:
        for stream, temperature in ((False, 0.0), (True, 0.7)):
            request(client, url, prompts[0], max_tokens, stream, temperature, model)
    end = time.monotonic() + seconds
    rss: list[float] = [server.rss_mb()]
    rss_at: list[float] = [time.monotonic()]

    def client_loop() -> None:
        nonlocal sent
        with httpx.Client(timeout=httpx.Timeout(900.0, connect=10.0)) as client:
            while time.monotonic() < end:
                with rng_lock:
                    if sent >= max_requests:
                        return
                    sent += 1
                    prompt = rng.choice(prompts)
                    stream = rng.random() < stream_share
                    temperature = rng.choice([0.0, 0.0, 0.7])
                result = request(client, url, prompt, max_tokens, stream, temperature, model)
                with rng_lock:
                    outcomes.append(result)

    def sample_rss() -> None:
        while time.monotonic() < end:
            time.sleep(min(5.0, max(0.5, seconds / 20)))
            rss.append(server.rss_mb())
            rss_at.append(time.monotonic())

    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    sampler = threading.Thread(target=sample_rss, daemon=True)
    t0 = time.monotonic()
    sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    rss.append(server.rss_mb())
    rss_at.append(time.monotonic())
    done = [o for o in outcomes if o.ok]
    ttft = [o.ttft for o in done if o.ttft is not None]
    server_ttft = [o.server_ttft for o in done if o.server_ttft is not None]
    rates = [o.tokens / o.latency for o in done if o.latency > 0]
    return {
        "clients": clients, "seconds": round(elapsed, 1), "sent": sent,
        "completed": len(done), "streamed": sum(o.stream for o in done),
        "failed": sum(1 for o in outcomes if not o.ok and o.status != 429 and not o.malformed),
        "rejected_429": sum(o.status == 429 for o in outcomes),
        "malformed": sum(bool(o.malformed) for o in outcomes),
        "errors": sorted({o.error or o.malformed for o in outcomes if not o.ok})[:10],
        "tokens": sum(o.tokens for o in done),
        "throughput_tokens_per_s": round(sum(o.tokens for o in done) / elapsed, 2),
        "ttft_stream_p50": _pct(ttft, 50), "ttft_stream_p95": _pct(ttft, 95),
        "ttft_server_p50": _pct(server_ttft, 50), "ttft_server_p95": _pct(server_ttft, 95),
        "request_tokens_per_s_p50": _pct(rates, 50), "request_tokens_per_s_p95": _pct(rates, 95),
        "rss_mb_cold": round(rss_cold, 1),
        "rss_mb_start": round(rss[0], 1), "rss_mb_end": round(rss[-1], 1),
        "rss_mb_growth": round(rss[-1] - rss[0], 1),
        "rss_mb_per_minute_second_half": _slope_per_minute(rss_at[len(rss) // 2:],
                                                           rss[len(rss) // 2:]),
        "rss_mb_max": round(max(rss), 1),
        # sampled through the run: growth that stops after the first requests is warm-up
        # (engines, profile, allocator pools); growth that goes on is a leak
        "rss_mb_series": [round(r, 1) for r in rss],
        "rss_mb_after_first_minute": round(rss[min(len(rss) - 1, max(1, len(rss) // 10))], 1),
    }


def _slope_per_minute(times: list[float], samples: list[float]) -> float | None:
    """Least-squares slope of RSS samples over their times, in MB per minute."""
    n = len(samples)
    if n < 3:
        return None
    xs = [(t - times[0]) / 60 for t in times]
    mx, my = sum(xs) / n, sum(samples) / n
    den = sum((x - mx) ** 2 for x in xs)
    return round(sum((x - mx) * (y - my) for x, y in zip(xs, samples, strict=True)) / den, 2)


def http_overhead_phase(url: str, model: str, prompts: list[str], max_tokens: int
                        ) -> list[Outcome]:
    with httpx.Client(timeout=900.0) as client:
        request(client, url, prompts[0], 4, False, 0.0, model)  # warm up
        return [request(client, url, p, max_tokens, i % 2 == 1, 0.0, model)
                for i, p in enumerate(prompts)]


def library_phase(args, prompts: list[str], max_tokens: int) -> list[tuple[float, int, str]]:
    try:
        from adaspec.methods.build import load_generator
    except ImportError:  # a checkout from before the rename (serve_ab.sh's "before")
        from adaspec.methods.build import load_engine as load_generator  # type: ignore

    engine = load_generator(args.method, args.target, args.draft, args.dtype, args.weights,
                         args.draft_weights)
    engine.generate(prompts[0], 4)  # warm up
    rows = []
    for p in prompts:
        t0 = time.perf_counter()
        result = engine.generate(p, max_tokens)
        rows.append((time.perf_counter() - t0, len(result.token_ids), result.text))
    return rows


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return round(statistics.fmean(kept), 2) if kept else None


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 4)
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 4)


# ---------------------------------------------------------------------- report
def summary_md(run: dict) -> str:
    load, over, cfg = run["load"], run["overhead"], run["config"]

    def f(v, unit=""):
        return "-" if v is None else f"{v:.3g}{unit}"

    lines = [
        "# adaspec serve under load",
        "",
        f"{run['date']} on {run['machine']}; target `{cfg['target']}`, draft `{cfg['draft']}`, "
        f"method `{cfg['method']}`, weights `{cfg.get('weights', cfg.get('quant'))}`; "
        "loopback only.",
        "",
        f"Command: `{run['command']}`",
        "",
        f"## Load: {load['clients']} clients for {load['seconds']} s",
        "",
        "| sent | completed (streamed) | failed | rejected (429) | malformed | tokens | "
        "tokens/s (all clients) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {load['sent']} | {load['completed']} ({load['streamed']}) | {load['failed']} | "
        f"{load['rejected_429']} | {load['malformed']} | {load['tokens']} | "
        f"{load['throughput_tokens_per_s']} |",
        "",
        "| measure | p50 | p95 |",
        "| --- | ---: | ---: |",
        f"| time to first token, streaming, at the client | {f(load['ttft_stream_p50'], ' s')} "
        f"| {f(load['ttft_stream_p95'], ' s')} |",
        f"| time to first token, server (queue + prefill) | {f(load['ttft_server_p50'], ' s')} "
        f"| {f(load['ttft_server_p95'], ' s')} |",
        f"| tokens/s per request (client latency) | {f(load['request_tokens_per_s_p50'])} | "
        f"{f(load['request_tokens_per_s_p95'])} |",
        "",
        f"Server RSS (process tree): {load.get('rss_mb_cold', 'n/a')} MB idle, "
        f"{load['rss_mb_start']} MB after two warm-up requests (the baseline), "
        f"{load['rss_mb_end']} MB at the end ({load.get('rss_mb_growth', 'n/a')} MB growth), "
        f"{load['rss_mb_max']} MB at most; "
        f"{load.get('rss_mb_after_first_minute', 'n/a')} MB a tenth of the way in; "
        f"slope over the second half {load.get('rss_mb_per_minute_second_half', 'n/a')} "
        "MB/min.",
        "",
    ]
    if load["errors"]:
        lines += ["Errors seen: " + "; ".join(f"`{e}`" for e in load["errors"]), ""]
    if over is None:  # --overhead-requests 0: the load phase only
        return "\n".join(lines)
    lines += [
        f"## Overhead: {over['requests']} greedy requests one at a time, "
        f"max_tokens {cfg['max_tokens']}",
        "",
        "| path | tokens | seconds | tokens/s |",
        "| --- | ---: | ---: | ---: |",
        f"| HTTP (half streamed) | {over['http_tokens']} | {over['http_seconds']} | "
        f"{over['http_tokens_per_s']} |",
        f"| library (`engine.generate`) | {over['lib_tokens']} | {over['lib_seconds']} | "
        f"{over['lib_tokens_per_s']} |",
        "",
        f"HTTP / library tokens/s: {over['ratio']} (overhead {over['overhead_pct']}%). "
        f"Texts equal: {over['same_text']}/{over['requests']}. The engine's own decode rate "
        f"inside the server (HTTP left out): {over['server_decode_tokens_per_s_plain']} "
        f"tokens/s not streamed, {over['server_decode_tokens_per_s_stream']} streamed.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--max-requests", type=int, default=5000)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--stream-share", type=float, default=0.5, help="share of streamed requests")
    p.add_argument("--suites", default="spec-bench,humaneval,codeedit")
    p.add_argument("--per-category", type=int, default=4, help="prompts per suite category")
    p.add_argument("--overhead-requests", type=int, default=12)
    p.add_argument("--method", default="auto")
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--weights", default="fastest")
    p.add_argument("--draft-weights", default="fastest")
    p.add_argument("--max-batch", default="auto", help="the server's --max-batch (default: "
                   "its own default; the committed runs before 2026-11-26 ran one at a time)")
    p.add_argument("--tiny", action="store_true",
                   help="random tiny models (a check that the script works; numbers mean nothing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="experiments/results/serve-load")
    args = p.parse_args()
    if not (0 < args.minutes <= MAX_MINUTES and 1 <= args.clients <= MAX_CLIENTS
            and 1 <= args.max_requests <= MAX_REQUESTS):
        raise SystemExit(f"bounds: 0 < minutes <= {MAX_MINUTES}, 1 <= clients <= "
                         f"{MAX_CLIENTS}, 1 <= max-requests <= {MAX_REQUESTS}")
    from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT

    env = dict(os.environ)
    if args.tiny:
        sys.path.insert(0, str(REPO))
        from tests.conftest import save_tiny_pair

        tmp = Path(tempfile.mkdtemp(prefix="serve-load-"))
        args.target, args.draft = save_tiny_pair(tmp, context=1024)
        args.dtype, args.weights, args.draft_weights = "float32", "none", "none"
        if args.method == "auto":
            args.method = "draft:k=3"
        env["ADASPEC_HOME"] = str(tmp / "home")
        # tiny models gain nothing from threads, and idle thread pools spinning next to the
        # clients on a small machine slow every forward many times over (tests/conftest.py)
        env["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)
    args.target = args.target or TARGET_DEFAULT
    args.draft = args.draft or DRAFT_DEFAULT
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = bench_prompts(args.suites.split(","), args.per_category)
    if args.tiny:  # the tiny models' context is 1024 tokens (about a character each)
        prompts = [p[:400] for p in prompts]
    overhead_prompts = random.Random(args.seed + 1).sample(
        prompts, min(args.overhead_requests, len(prompts)))

    server = Server(["--method", args.method, "--target", args.target, "--draft", args.draft,
                     "--dtype", args.dtype, "--weights", args.weights, "--draft-weights",
                     args.draft_weights, "--max-queue", str(args.clients),
                     "--max-batch", args.max_batch, "--model-name", "adaspec"],
                    out / "server.log", env)
    print(f"server at {server.url}; load: {args.clients} clients, {args.minutes} min",
          flush=True)
    try:
        load = load_phase(server.url, "adaspec", prompts, args.clients, 60 * args.minutes,
                          args.max_requests, args.max_tokens, args.stream_share, args.seed,
                          server)
        print(json.dumps(load), flush=True)
        http = http_overhead_phase(server.url, "adaspec", overhead_prompts, args.max_tokens) \
            if overhead_prompts else []
    finally:
        code = server.stop()
    if not overhead_prompts:  # --overhead-requests 0: the load phase only
        return _write(out, args, load, None, code, [])
    print(f"server stopped (exit {code}); the same requests through the library", flush=True)
    if args.tiny:
        os.environ["ADASPEC_HOME"] = env["ADASPEC_HOME"]
    lib = library_phase(args, overhead_prompts, args.max_tokens)
    http_tokens = sum(o.tokens for o in http)
    http_seconds = sum(o.latency for o in http)
    lib_tokens = sum(n for _, n, _ in lib)
    lib_seconds = sum(t for t, _, _ in lib)
    http_rate = http_tokens / http_seconds if http_seconds else 0.0
    lib_rate = lib_tokens / lib_seconds if lib_seconds else 0.0
    overhead = {
        "requests": len(http), "http_tokens": http_tokens,
        "http_seconds": round(http_seconds, 3), "http_tokens_per_s": round(http_rate, 2),
        "lib_tokens": lib_tokens, "lib_seconds": round(lib_seconds, 3),
        "lib_tokens_per_s": round(lib_rate, 2),
        "ratio": round(http_rate / lib_rate, 4) if lib_rate else None,
        "overhead_pct": round(100 * (1 - http_rate / lib_rate), 2) if lib_rate else None,
        "same_text": sum(o.text == t for o, (_, _, t) in zip(http, lib, strict=True)),
        # the engine's own decode rate inside the server (HTTP left out), streamed or not
        "server_decode_tokens_per_s_stream": _mean(
            [o.decode_tokens_per_s for o in http if o.stream]),
        "server_decode_tokens_per_s_plain": _mean(
            [o.decode_tokens_per_s for o in http if not o.stream]),
        "http_failed": sum(not o.ok for o in http),
    }
    return _write(out, args, load, overhead, code, http)


def _write(out: Path, args, load: dict, overhead: dict | None, code, http: list) -> int:
    run = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": _cpu_name(), "command": " ".join(["python", *sys.argv]),
        "config": {k: getattr(args, k) for k in ("method", "target", "draft", "dtype", "weights",
                                                 "draft_weights", "max_tokens", "clients",
                                                 "minutes", "stream_share", "suites")},
        "load": load, "overhead": overhead, "server_exit": code,
        "http_overhead_requests": [asdict(o) for o in http],
    }
    (out / "run.json").write_text(json.dumps(run, indent=1))
    (out / "summary.md").write_text(summary_md(run))
    print(summary_md(run))
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
