"""The concurrency sweep's harness (experiments/concurrency_sweep.py) against a fake server:
its clients' protocol checks, a wave's bookkeeping, llama-server's fall-backs as the sweep
records them, and the targets it reads from the rows. The numbers it reports are only as
honest as these parts."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))

import concurrency_sweep as sweep  # noqa: E402

from .test_bench_llama_server import FAKE_START, write_fake  # noqa: E402

# A stand-in for an OpenAI-compatible server: /health, and streamed chat completions whose
# user message picks how the answer goes wrong (or not). As the sweep's llama-server it also
# dies of SIGSEGV while loading without --no-repack (FAKE_CRASH_AT_START) and on its first
# completion with a speculative type (FAKE_SPEC_CRASH).
FAKE = FAKE_START + r'''
if os.environ.get("FAKE_SAY"):  # what a system's environment told this server
    print("said " + os.environ["FAKE_SAY"], flush=True)


def events(mode, n):
    yield {"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]}
    for i in range(n):
        yield {"choices": [{"delta": {"content": "w%d " % i}, "finish_reason": None}]}
    yield {"choices": [{"delta": {}, "finish_reason": "length"}]}
    if mode == "two-finish":
        yield {"choices": [{"delta": {}, "finish_reason": "stop"}]}
    used = n + 5 if mode == "too-many" else n
    if mode != "no-usage":
        yield {"choices": [], "usage": {"completion_tokens": used, "prompt_tokens": 3},
               "timings": {"predicted_per_second": 12.5}}


class Handler(Health):
    def log_message(self, *a):
        pass

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if spec != "none" and os.environ.get("FAKE_SPEC_CRASH"):
            crash()
        mode = req["messages"][-1]["content"].split()[0]
        if mode == "fail":
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"busy")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in events(mode, req["max_tokens"]):
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.wfile.flush()
        if mode == "cut":
            return
        self.wfile.write(b"data: [DONE]\n\n")
        if mode == "after-done":
            self.wfile.write(b"data: {}\n\n")


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.fixture
def fake_binary(tmp_path):
    return write_fake(tmp_path / "fake-server", FAKE)


@pytest.fixture
def fake_port(fake_binary, tmp_path):
    """The fake running on a free port (started as the sweep starts servers)."""
    from adaspec.lab.bench.llama_server import LlamaServer

    server = LlamaServer(fake_binary, [], tmp_path / "fake.log", 30.0).start()
    yield server.port
    server.close()


def _record(prompt: str = "p") -> sweep.Record:
    return sweep.Record("sys", 1, 0, 0, prompt, "suite")


def _ask(port: int, text: str, max_tokens: int = 4, **kw) -> sweep.Record:
    return sweep.chat_request(port, sweep.chat_body(text, max_tokens, "m"), _record(),
                              timeout=30.0, **kw)


def test_a_well_formed_stream_is_ok_with_its_tokens_ttft_and_server_figures(fake_port):
    rec = _ask(fake_port, "ok please", max_tokens=5)
    assert rec.outcome == "ok", rec.error
    assert (rec.completion_tokens, rec.content_chunks, rec.finish_reason) == (5, 5, "length")
    assert rec.text_chars == len("".join(f"w{i} " for i in range(5)))
    assert rec.ttft is not None and rec.latency is not None and rec.ttft <= rec.latency
    assert sweep._server_decode_rate(rec) == 12.5  # server-side, kept apart


@pytest.mark.parametrize(("mode", "outcome", "why"), [
    ("two-finish", "malformed", "finish_reason"),
    ("after-done", "malformed", "after [DONE]"),
    ("too-many", "malformed", "completion_tokens"),
    ("no-usage", "malformed", "no usage"),
    ("cut", "lost", "before [DONE]"),
    ("fail", "failed", "busy"),
])
def test_a_broken_answer_is_counted_as_what_went_wrong(fake_port, mode, outcome, why):
    rec = _ask(fake_port, f"{mode} please")
    assert rec.outcome == outcome
    assert why in rec.error
    assert rec.latency is None  # only ok requests are timed


def test_a_refused_connection_is_lost_not_a_crash():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rec = _ask(port, "ok")
    assert rec.outcome == "lost" and "Error" in rec.error


def test_a_client_that_disconnects_on_purpose_is_not_lost(fake_port):
    rec = _ask(fake_port, "ok", max_tokens=8, disconnect_after=2)
    assert (rec.outcome, rec.content_chunks) == ("disconnected", 2)


def test_a_wave_sends_every_prompt_once_client_by_client(fake_port, tmp_path):
    class Fixed(sweep.Peer):
        port = fake_port

    ctx = _context(tmp_path, None)
    prompts = [sweep.SweepPrompt(f"id{i}", "s", f"ok {i}") for i in range(6)]
    system = sweep.System("adaspec:ar", "adaspec", method="ar")
    records, wall = sweep.run_wave(Fixed(), system, 3, prompts, 2, ctx, "adaspec")
    assert sorted((r.client, r.seq, r.prompt) for r in records) == [
        (i, j, f"id{i + 3 * j}") for i in range(3) for j in range(2)]
    assert all(r.outcome == "ok" and 0 <= r.sent_at < wall for r in records)
    summary = sweep.summarize(records, wall)
    assert (summary["ok"], summary["completion_tokens"]) == (6, 6 * ctx.max_tokens)
    assert summary["agg_tokens_per_s"] == round(6 * ctx.max_tokens / wall, 2)


def test_systems_parse_with_commas_inside_methods_and_bad_ones_say_why():
    systems = sweep.parse_systems("adaspec:auto,adaspec-fifo:ngram:k=4,llama-server,"
                                  "llama-server:spec=ngram-mod,adaspec:fixed", "ngram:k=3")
    assert [(s.kind, s.method, s.spec) for s in systems] == [
        ("adaspec", "auto", "none"), ("adaspec-fifo", "ngram:k=4", "none"),
        ("llama-server", "", "none"), ("llama-server", "", "ngram-mod"),
        ("adaspec", "ngram:k=3", "none")]
    for bad, says in [("adaspec:", "give a method"), ("llama-server:ngram", "spec=TYPE"),
                      ("llama-server:spec=eagle", "spec types here"), ("vllm", "unknown system")]:
        with pytest.raises(SystemExit, match=says):
            sweep.parse_systems(bad, "ngram:k=4")


def test_an_adaspec_system_sets_environment_variables_for_its_own_server(fake_binary,
                                                                        tmp_path):
    off, plain = sweep.parse_systems("adaspec:ngram:k=4@FAKE_SAY=tiles-off@B=2,adaspec:auto",
                                     "ngram:k=3")
    assert (off.label, off.method) == ("adaspec:ngram:k=4@FAKE_SAY=tiles-off@B=2", "ngram:k=4")
    assert off.env == (("FAKE_SAY", "tiles-off"), ("B", "2")) and plain.env == ()
    ctx = dataclasses.replace(_context(tmp_path, None), adaspec_bin=fake_binary)
    for system, said in ((off, True), (plain, False)):
        peer, _ = sweep.start_adaspec(ctx, system, 2, True)
        peer.close()
        log = ctx.log_path(system, 2).read_text()
        assert ("said tiles-off" in log) is said, log


def _context(tmp_path: Path, llama_bin: Path | None) -> sweep.Context:
    gguf = tmp_path / "target.gguf"
    gguf.write_bytes(b"GGUF")
    return sweep.Context(out=tmp_path / "out", adaspec_bin=Path("adaspec"), adaspec_args=[],
                         history="off", target="t", gguf=gguf, llama_bin=llama_bin, threads=1,
                         ctx_per_slot=256, request_timeout=30.0, startup_timeout=30.0,
                         max_tokens=3)


def _llama_row(tmp_path, binary, spec="none"):
    ctx = _context(tmp_path, binary)
    system = sweep.System("llama-server" if spec == "none" else f"llama-server:spec={spec}",
                          "llama-server", spec=spec)
    prompts = [sweep.SweepPrompt(f"id{i}", "s", f"ok {i}") for i in range(2)]
    said: list[str] = []
    row = sweep.measure(ctx, system, 2, prompts, sweep.SweepPrompt("w", "s", "ok warm"), 1,
                        said.append)
    return row, said, ctx


def test_llama_server_crashing_at_load_is_measured_with_no_repack_and_says_so(
        tmp_path, fake_binary, monkeypatch):
    monkeypatch.setenv("FAKE_CRASH_AT_START", "1")
    row, said, _ = _llama_row(tmp_path, fake_binary)
    assert row["summary"]["ok"] == 2, row
    assert "--no-repack" in row["server"]["args"] and "-np" in row["server"]["args"]
    assert [f["what"] for f in row["fallbacks"]] == ["repack"]
    assert any("no-repack" in s for s in said)
    run = {"rows": [row]}
    assert sweep._row_marks(sweep.combined(run)[0]) == " (--no-repack)"


def test_a_crashing_speculative_type_is_measured_plain_and_left_out_of_the_targets(
        tmp_path, fake_binary, monkeypatch):
    monkeypatch.setenv("FAKE_SPEC_CRASH", "1")
    row, said, ctx = _llama_row(tmp_path, fake_binary, spec="ngram-mod")
    assert row["summary"]["ok"] == 2, row
    assert row["server"]["spec_run"] == "none"
    # a crash at the warm-up is first taken for the repacking one (restarted with
    # --no-repack); it crashes again, so the type is given up
    assert [(f["what"], f.get("from")) for f in row["fallbacks"]] == [
        ("repack", None), ("spec", "ngram-mod")]
    assert ctx.notes and "measured plain llama-server instead" in ctx.notes[0]
    # a plain row standing in for a speculative type must not count as that type
    run = _run([("adaspec:ar", 8, 60.0), ("llama-server", 8, 30.0)])
    run["rows"].append({**_fake_row("llama-server:spec=ngram-mod", 8, 100.0),
                        "fallbacks": row["fallbacks"]})
    assert "best adaspec / best llama-server 2.00 (target >= 2.0)" in "\n".join(
        sweep.targets_md(run))


def _fake_row(system: str, c: int, rate: float, ttft: float = 1.0) -> dict:
    tokens, wall = 100, 100 / rate
    rec = sweep.Record(system, c, 0, 0, "p", "s", outcome="ok", latency=wall, ttft=ttft,
                       completion_tokens=tokens)
    return {"system": system, "concurrency": c, "fallbacks": [], "server": {"max_batch": c},
            "summary": sweep.summarize([rec], wall), "requests": [sweep.asdict(rec)]}


def _run(rows: list[tuple]) -> dict:
    return {"settings": {"fixed": "ngram:k=4", "clients": sorted({r[1] for r in rows})},
            "rows": [_fake_row(*r) for r in rows]}


def test_the_targets_read_from_the_rows():
    run = _run([("adaspec:auto", 8, 58.0, 1.0), ("adaspec:ar", 8, 60.0),
                ("adaspec:ngram:k=4", 8, 50.0), ("adaspec-fifo:auto", 8, 30.0, 4.0),
                ("llama-server", 8, 25.0), ("llama-server:spec=ngram-mod", 8, 40.0),
                ("adaspec:auto", 1, 30.0), ("adaspec-fifo:auto", 1, 31.0)])
    lines = "\n".join(sweep.targets_md(run))
    assert "best adaspec / best llama-server 1.50 (target >= 2.0)" in lines
    assert "auto / max(ar, ngram:k=4) 0.967 (target >= 0.97)" in lines
    assert "p95 TTFT auto / adaspec-fifo:auto 0.25 (target <= 0.5)" in lines
    assert "auto / adaspec-fifo:auto 0.968 (target >= 0.97)" in lines
    assert "need `adaspec-fifo:auto`" not in lines
    assert "modelled" not in lines  # no rounds: nothing modelled to read
    for row, decode in zip(run["rows"][:3], (10.0, 12.0, 11.0), strict=True):
        row["rounds"] = {"seconds": {}, "rounds": {}, "modelled_seconds": {"decode": decode},
                         "prompt_tokens": 0, "step_tokens": 0, "cut_tokens": 0}
    lines = "\n".join(sweep.targets_md(run))
    assert ("decode rounds modelled, min(ar, ngram:k=4) / auto 1.100 (modelled, not timed)"
            in lines)


def test_repeats_take_the_median_rate_and_keep_the_range():
    run = _run([("adaspec:ar", 4, 10.0), ("adaspec:ar", 4, 30.0), ("adaspec:ar", 4, 20.0)])
    (row,) = sweep.combined(run)
    assert (row["repeats"], row["measured"]) == (3, 3)
    assert row["summary"]["agg_tokens_per_s"] == 20.0
    assert row["summary"]["agg_tokens_per_s_range"] == [10.0, 30.0]
    assert row["summary"]["ok"] == 3  # the requests pool


def test_repeats_are_also_compared_within_each_repeat():
    """auto against the better fixed method wave by wave inside each repeat (the waves of a
    repeat run back to back), beside the medians' ratio."""
    run = _run([("adaspec:auto", 4, 40.0), ("adaspec:ar", 4, 42.0), ("adaspec:ngram:k=4", 4, 41.0),
                ("adaspec:auto", 4, 50.0), ("adaspec:ar", 4, 49.0), ("adaspec:ngram:k=4", 4, 50.0),
                ("adaspec:auto", 4, 45.0), ("adaspec:ar", 4, 45.0)])  # repeat 3 lacks one
    for i, row in enumerate(run["rows"]):
        row["repeat"] = i // 3
    assert [round(v, 3) for v in sweep.paired_ratios(run, 4)] == [0.952, 1.0]
    lines = "\n".join(sweep.targets_md(run))
    assert "paired by repeat, median of auto / max(ar, ngram:k=4) 0.976 (0.952, 1.000)" in lines
    assert "auto / max(ar, ngram:k=4) 0.989" in lines  # medians: 45 / max(45, 45.5)
    run["rows"] = run["rows"][:3]
    assert "paired" not in "\n".join(sweep.targets_md(run))  # one repeat: nothing to pair


def test_each_wave_lists_the_machine_probe_taken_before_it():
    run = _run([("adaspec:auto", 2, 40.0), ("adaspec:ar", 2, 30.0)])
    run["rows"][0]["probe"] = {"matmul_gflops": 250.0, "copy_gbs": 13.5}
    run["rows"][1]["probe"] = None  # the probe could not run: the wave is left out
    table = "\n".join(sweep.waves_md(run))
    assert "| 2 | 1 | adaspec:auto | 40.0 | 250.0 | 13.50 |" in table
    assert "adaspec:ar" not in table
    probe = sweep.machine_probe()  # a real one, in a fresh process
    assert probe is not None and probe["matmul_gflops"] > 0 and probe["copy_gbs"] > 0


def test_the_fake_server_fixture_serves_concurrent_streams(fake_port):
    """The wave test above relies on the fake answering clients at once."""
    results: list[sweep.Record] = []
    threads = [threading.Thread(target=lambda: results.append(_ask(fake_port, "ok")))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.outcome for r in results] == ["ok"] * 4



def test_the_server_time_split_reads_the_servers_round_counters():
    """A wave's rounds are its /metrics counters less the warm-up's, summed over repeats
    and written as prefill and decode seconds."""
    from adaspec.engine.batch import RoundStats
    from adaspec.serve.metrics import ServeMetrics

    def round_(requests: int, prompt: int, step: int, cut: int, seconds: float) -> RoundStats:
        return RoundStats(sequences=requests, tokens=prompt + step, prefill_tokens=prompt,
                          cut=cut, call_seconds=seconds)

    metrics = ServeMetrics(lambda: 0.0, lambda: 0.0)
    metrics.batch_round(round_(1, 40, 0, 0, 0.5))  # the warm-up's prompt
    before = sweep.parse_round_counters(metrics.render().decode())
    metrics.batch_round(round_(3, 100, 2, 0, 1.5), 1200.0)
    metrics.batch_round(round_(3, 0, 5, 4, 0.25), 300.0)  # (modelled: priced by the curve)
    metrics.batch_round(round_(2, 0, 2, 0, 0.25), 150.0)
    split = sweep.round_split(before, sweep.parse_round_counters(metrics.render().decode()))
    assert split == {"seconds": {"prefill": 1.5, "decode": 0.5},
                     "rounds": {"prefill": 1, "decode": 2},
                     "modelled_seconds": {"prefill": 1.2, "decode": 0.45},
                     "prompt_tokens": 100, "step_tokens": 9, "cut_tokens": 4}
    run = _run([("adaspec:ar", 8, 10.0), ("adaspec:ar", 8, 12.0)])
    for row in run["rows"]:
        row["rounds"] = {**split, "cpu_seconds": {"server": 1.25, "runtimes": 7.5,
                                                  "children": [6.0, 1.5], "steal": 0.5}}
    (row,) = sweep.combined(run)
    assert row["rounds"]["seconds"] == {"prefill": 3.0, "decode": 1.0}
    assert row["rounds"]["cpu_seconds"] == {"server": 2.5, "runtimes": 15.0, "steal": 1.0}
    table = "\n".join(sweep.rounds_md(run))
    assert ("| adaspec:ar | 8 | 3.0 (2) | 1.0 (4) | 0.90 | 0.75 | 200 | 18 | 8 | "
            "2.5 / 15.0 / 1.0 |") in table


def test_a_waves_cpu_is_split_between_the_server_and_its_children():
    """The server's own CPU seconds apart from its runtime children's (/proc)."""
    import subprocess
    import time

    burn = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: "
            "pass\nprint('burnt', flush=True)\nsys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        me = os.getpid()
        before = sweep.cpu_seconds(me)
        assert child.pid in before and me in before
        assert child.stdout is not None and child.stdout.readline() == "burnt\n"
        t = time.process_time()  # the server's own share: CPU time, not the clock's
        while time.process_time() - t < 0.1:
            pass
        split = sweep.cpu_split(me, before, sweep.cpu_seconds(me))
        assert split["runtimes"] >= 0.25 - before[child.pid]
        assert split["children"][0] >= 0.25 - before[child.pid]  # (the most first)
        assert split["server"] >= 0.05
        assert split["idle"] >= 0.0 and split["steal"] >= 0.0
    finally:
        child.communicate("")


def test_each_concurrency_starts_its_waves_at_another_system():
    systems = sweep.parse_systems("adaspec:auto,adaspec:ar,llama-server", "ngram:k=4")
    first = [sweep.wave_order(systems, 1, step)[0][1].label for step in range(3)]
    assert first == ["adaspec:auto", "adaspec:ar", "llama-server"]
    order = sweep.wave_order(systems, 2, 0)
    assert [k for k, _ in order] == [0, 0, 0, 1, 1, 1]
    assert [s.label for _, s in order][3] == "adaspec:ar"  # the next repeat rotates too
    assert sorted(s.label for _, s in order[:3]) == sorted(s.label for s in systems)
