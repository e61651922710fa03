"""Build the bench's peers as their users build them: llama.cpp's own `llama-server`.

The source is the llama.cpp that the pinned `llama-cpp-python` sdist vendors
(`vendor/llama.cpp`), so the server and the `llamacpp` reference run the same llama.cpp. It is
fetched with pip (`pip download --no-deps --no-binary :all: llama-cpp-python==VERSION`, from
pip's cache when it is there) and built with cmake as llama.cpp's README builds it: Release,
native CPU (`GGML_NATIVE`, llama.cpp's default), only the `llama-server` target, statically
linked (one self-contained binary, so the finished folder can be moved into place), no web UI
download, no OpenSSL. About 10 minutes on 2 cores.

Layout under `$ADASPEC_HOME/peers/`:

- `llama.cpp-VERSION/bin/llama-server` and `build.json` (what was built, from which commit,
  for which CPU, in how long): the finished build, renamed into place in one step
  (`store.atomic.atomic_dir`), so an interrupted build never leaves a folder that looks
  complete;
- `.build-llama.cpp-VERSION/`: the source and cmake's build folder while building; kept
  after a failure or an interruption (the next build resumes where it stopped), removed
  after a success.

A native build runs only on the CPU it was built for: `build.json` records the CPU, and a
binary built for another one is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

from adaspec.errors import AdaspecError

# The llama-cpp-python whose vendored llama.cpp is built: the version the `llamacpp` extra pins
# (pyproject.toml), so `llama-server` and the `llamacpp` reference run the same llama.cpp.
LLAMA_CPP_PYTHON = "0.3.36"
SERVER = "llama-server"
BUILD_INFO = "build.json"
# cmake -D options: Release, this CPU's instruction sets, one static binary, nothing fetched
# from the network (no web UI assets, no OpenSSL), no tests or examples.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)


class PeerUnavailable(AdaspecError):
    """A peer cannot be built or run here; the message names the missing piece and the fix."""


def peers_dir() -> Path:
    from adaspec.store.assembly import adaspec_home

    return adaspec_home() / "peers"


def server_dir(version: str = LLAMA_CPP_PYTHON) -> Path:
    """The finished build of llama-server (whether or not it exists)."""
    return peers_dir() / f"llama.cpp-{version}"


def server_binary(version: str = LLAMA_CPP_PYTHON) -> Path:
    return server_dir(version) / "bin" / SERVER


def work_dir(version: str = LLAMA_CPP_PYTHON) -> Path:
    """Source and build folder while a build runs (hidden: not a finished build)."""
    return peers_dir() / f".build-llama.cpp-{version}"


def cpu_signature() -> dict:
    """What a native build depends on: the architecture, the CPU model and a hash of its
    feature flags."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")) and not flags:
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return {
        "machine": platform.machine(),
        "cpu": model or platform.processor() or platform.machine(),
        "flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16],
    }


def build_info(version: str = LLAMA_CPP_PYTHON) -> dict | None:
    """The finished build's record, or None when there is none (or it is unreadable)."""
    try:
        info = json.loads((server_dir(version) / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def built_server(version: str = LLAMA_CPP_PYTHON) -> Path | None:
    """The llama-server binary when a finished build for this CPU is installed, else None."""
    binary = server_binary(version)
    info = build_info(version)
    if info is None or not os.access(binary, os.X_OK):
        return None
    if info.get("cpu_signature") != cpu_signature():
        return None
    return binary


# ----------------------------------------------------------------------------- tools


def _venv_tool(name: str) -> str | None:
    """A tool on PATH, or beside this Python (a virtual environment's `pip install cmake`)."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    return str(beside) if os.access(beside, os.X_OK) else None


def find_tools() -> dict[str, str]:
    """cmake, a C and a C++ compiler and a build tool (ninja or make), or PeerUnavailable
    naming what is missing and how to install it, in one line."""
    tools: dict[str, str] = {}
    missing: list[str] = []
    cmake = _venv_tool("cmake")
    if cmake:
        tools["cmake"] = cmake
    else:
        missing.append("cmake")
    for role, env, names in (("cc", "CC", ("cc", "gcc", "clang")),
                             ("c++", "CXX", ("c++", "g++", "clang++"))):
        chosen = os.environ.get(env)
        found = shutil.which(chosen) if chosen else None
        found = found or next((p for p in map(shutil.which, names) if p), None)
        if found:
            tools[role] = found
        else:
            missing.append(f"a {'C' if role == 'cc' else 'C++'} compiler")
    ninja, make = _venv_tool("ninja"), shutil.which("make")
    if ninja:
        tools["ninja"] = ninja
    elif make:
        tools["make"] = make
    else:
        missing.append("ninja or make")
    if missing:
        raise PeerUnavailable(
            f"building {SERVER} needs {', '.join(missing)}: apt-get install cmake "
            "build-essential (or pip install cmake ninja into this environment)"
        )
    return tools


# ----------------------------------------------------------------------------- source


def _pip_download(version: str, into: Path, log: Callable[[str], None]) -> Path:
    """The llama-cpp-python sdist, downloaded by pip (from its cache when it has it)."""
    into.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{version}.tar.gz"
    if (into / name).is_file():
        return into / name
    log(f"{SERVER}: fetching llama-cpp-python {version}'s source with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", f"llama-cpp-python=={version}", "-d", str(into)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(into.glob(f"llama_cpp_python-{version}.tar.gz"))
    if done.returncode != 0 or not found:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PeerUnavailable(
            f"pip could not download llama-cpp-python {version}'s source ({last[0]}); "
            f"put {name} into {into} and retry"
        )
    return found[0]


def extract_llama_cpp(sdist: Path, dest: Path) -> str:
    """Unpack the sdist's `vendor/llama.cpp` into `dest`; returns the vendored commit (from
    the sdist's submodule record) or 'unknown'."""
    commit = "unknown"
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/")
            if parts[1:3] == ["vendor", "llama.cpp"] and len(parts) > 3:
                if parts[3] == ".git":  # a submodule link to a folder the sdist lacks
                    continue
                m.name = "/".join(parts[3:])
                members.append(m)
            elif parts[1:] == [".git", "modules", "vendor", "llama.cpp", "HEAD"]:
                f = tar.extractfile(m)
                if f is not None:
                    commit = f.read().decode(errors="replace").strip() or commit
        if not members:
            raise PeerUnavailable(f"{sdist.name} holds no vendor/llama.cpp: not the expected "
                                  "llama-cpp-python source")
        dest.mkdir(parents=True, exist_ok=True)
        tar.extractall(dest, members=members, filter="data")
    return commit


# ----------------------------------------------------------------------------- build

_PERCENT = re.compile(r"^\[\s*(\d+)%\]")  # make: [ 45%] Building ...
_STEPS = re.compile(r"^\[(\d+)/(\d+)\]")  # ninja: [12/150] Building ...


def progress_of(line: str) -> float | None:
    """The build's progress in [0, 1] from one line of its output, if the line tells it."""
    m = _STEPS.match(line)
    if m and int(m.group(2)):
        return int(m.group(1)) / int(m.group(2))
    m = _PERCENT.match(line)
    return int(m.group(1)) / 100 if m else None


class _Progress:
    """One line that says how far the build is: rewritten in place on a terminal, a new line
    every 10% otherwise."""

    def __init__(self, what: str, stream=None) -> None:
        self.what = what
        self.stream = stream or sys.stderr
        self.t0 = time.monotonic()
        self.shown = -1
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, fraction: float, stage: str = "compiling") -> None:
        pct = int(100 * fraction)
        if not self.tty and pct // 10 == self.shown // 10 and self.shown >= 0:
            return
        self.shown = pct
        elapsed = int(time.monotonic() - self.t0)
        text = f"{self.what}: {stage} {pct:3d}% ({elapsed // 60}m{elapsed % 60:02d}s)"
        end = "" if self.tty else "\n"
        print(("\r" if self.tty else "") + text, end=end, file=self.stream, flush=True)

    def done(self) -> None:
        if self.tty:
            print(file=self.stream, flush=True)


def _run_logged(cmd: list[str], log_file, env: dict, on_line=None) -> int:
    log_file.write(f"$ {' '.join(cmd)}\n")
    log_file.flush()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, errors="replace")
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            log_file.write(line)
            if on_line is not None:
                on_line(line)
        return proc.wait()
    except BaseException:  # an interrupt stops the compilers too
        proc.kill()
        proc.wait()
        raise


def _tail(path: Path, n: int = 1) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if "error" in ln.lower()]
    return " | ".join((errors or lines)[-n:])[:300]


def build_server(
    force: bool = False,
    jobs: int = 2,
    version: str = LLAMA_CPP_PYTHON,
    log: Callable[[str], None] | None = None,
    progress_stream=None,
) -> Path:
    """Build llama-server from llama-cpp-python `version`'s vendored llama.cpp (unless a
    finished build for this CPU is installed and not `force`); returns the binary."""
    from adaspec.store.atomic import atomic_dir, atomic_open, write_json

    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    if not force and (found := built_server(version)) is not None:
        return found
    tools = find_tools()
    work = work_dir(version)
    src, build = work / "llama.cpp", work / "build"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    commit_file = work / "commit"
    if not (src / "CMakeLists.txt").is_file():
        sdist = _pip_download(version, work / "download", say)
        shutil.rmtree(src, ignore_errors=True)
        with atomic_open(commit_file) as f:
            f.write(extract_llama_cpp(sdist, src))
    commit = commit_file.read_text().strip() if commit_file.is_file() else "unknown"
    log_path = work / "build.log"
    env = {**os.environ, "CC": tools["cc"], "CXX": tools["c++"],
           "GIT_DIR": str(work / "no-git")}  # no version stamp from a git repo around it
    generator = ["-G", "Ninja"] if "ninja" in tools else ["-G", "Unix Makefiles"]
    if "ninja" in tools:
        generator.append(f"-DCMAKE_MAKE_PROGRAM={tools['ninja']}")
    cache = build / "CMakeCache.txt"
    if cache.is_file() and ("Ninja" in generator) != ("CMAKE_GENERATOR:INTERNAL=Ninja"
                                                       in cache.read_text(errors="replace")):
        shutil.rmtree(build)  # another build tool than the one that started this folder
    bar = _Progress(f"building {SERVER} (llama.cpp {commit[:10]} from llama-cpp-python "
                    f"{version}, {jobs} jobs; log {log_path})", progress_stream)
    bar.update(0.0, "configuring")
    with log_path.open("a", encoding="utf-8") as logf:
        code = _run_logged([tools["cmake"], "-S", str(src), "-B", str(build), *generator,
                            *CMAKE_OPTIONS], logf, env)
        if code == 0:
            code = _run_logged(
                [tools["cmake"], "--build", str(build), "--target", SERVER, "-j", str(jobs)],
                logf, env,
                lambda line: (p := progress_of(line)) is not None and bar.update(p),
            )
    bar.done()
    built = next((p for p in (build / "bin" / SERVER, build / SERVER) if p.is_file()), None)
    if code != 0 or built is None:
        raise PeerUnavailable(
            f"building {SERVER} failed ({_tail(log_path) or f'exit code {code}'}); full log: "
            f"{log_path} (run `adaspec bench build-peers` again to resume)"
        )
    seconds = round(time.monotonic() - t0, 1)
    with atomic_dir(server_dir(version)) as tmp:
        (tmp / "bin").mkdir()
        shutil.copy2(built, tmp / "bin" / SERVER)
        write_json(tmp / BUILD_INFO, {
            "peer": SERVER,
            "llama_cpp_python": version,
            "llama_cpp_commit": commit,
            "cmake_options": list(CMAKE_OPTIONS),
            "generator": generator[1],
            "compilers": {"cc": tools["cc"], "c++": tools["c++"]},
            "cpu_signature": cpu_signature(),
            "build_seconds": seconds,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        })
    shutil.rmtree(work, ignore_errors=True)
    say(f"{SERVER}: built in {seconds / 60:.1f} min -> {server_binary(version)}")
    return server_binary(version)


def ensure_server(log: Callable[[str], None] | None = None) -> Path:
    """The llama-server binary, built first when there is none for this CPU (a bench method
    that needs it builds it on first use)."""
    found = built_server()
    if found is not None:
        return found
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    why = "built for another CPU" if build_info() is not None else "not built yet"
    say(f"{SERVER}: {why}; building it now (about 10 minutes on 2 cores; once)")
    return build_server(log=say)
