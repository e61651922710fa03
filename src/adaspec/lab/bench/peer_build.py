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

One variant, `no-amx` (`llama.cpp-VERSION-no-amx/`): the same native build with the compiler
told the CPU has no AMX (`-mno-amx-*`), so llama.cpp compiles no AMX kernels and its repacking
uses its AVX kernels instead. On CPUs with AMX, llama.cpp's AMX path can crash at the first
graph (killed by SIGSEGV or SIGILL on two Intel Xeon VMs here; llama.cpp issue 20824 reports
the same in `ggml_backend_amx_mul_mat`): the bench then runs this build, repacking still on,
rather than turning repacking off (`lab/bench/llama_server.LlamaServerDecoder.fall_back`).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from adaspec.store import native_build
from adaspec.store.native_build import NativeBuildError, cpu_signature

# The llama-cpp-python whose vendored llama.cpp is built: the version the `llamacpp` extra pins
# (pyproject.toml), so `llama-server` and the `llamacpp` reference run the same llama.cpp.
LLAMA_CPP_PYTHON = "0.3.36"
SERVER = "llama-server"
BUILD_INFO = native_build.BUILD_INFO
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


# The variants a build can be: "" (the stock native build) and NO_AMX, its options added.
NO_AMX = "no-amx"
_NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
VARIANT_OPTIONS: dict[str, tuple[str, ...]] = {
    "": (),
    NO_AMX: (f"-DCMAKE_C_FLAGS={_NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={_NO_AMX_FLAGS}"),
}


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX (where llama.cpp's stock native build runs its AMX kernels)."""
    return "amx_int8" in native_build.cpu_flags()


class PeerUnavailable(NativeBuildError):
    """A peer cannot be built or run here; the message names the missing piece and the fix."""


def peers_dir() -> Path:
    from adaspec.store.assembly import adaspec_home

    return adaspec_home() / "peers"


def _name(version: str, variant: str) -> str:
    if variant not in VARIANT_OPTIONS:
        raise ValueError(f"unknown llama-server build variant {variant!r}")
    return f"llama.cpp-{version}" + (f"-{variant}" if variant else "")


def server_dir(version: str = LLAMA_CPP_PYTHON, variant: str = "") -> Path:
    """The finished build of llama-server (whether or not it exists)."""
    return peers_dir() / _name(version, variant)


def server_binary(version: str = LLAMA_CPP_PYTHON, variant: str = "") -> Path:
    return server_dir(version, variant) / "bin" / SERVER


def work_dir(version: str = LLAMA_CPP_PYTHON, variant: str = "") -> Path:
    """Source and build folder while a build runs (hidden: not a finished build)."""
    return peers_dir() / f".build-{_name(version, variant)}"


def build_info(version: str = LLAMA_CPP_PYTHON, variant: str = "") -> dict | None:
    """The finished build's record, or None when there is none (or it is unreadable)."""
    return native_build.read_build_info(server_dir(version, variant))


def built_server(version: str = LLAMA_CPP_PYTHON, variant: str = "") -> Path | None:
    """The llama-server binary when a finished build for this CPU is installed, else None."""
    binary = server_binary(version, variant)
    info = build_info(version, variant)
    if info is None or not os.access(binary, os.X_OK):
        return None
    if info.get("cpu_signature") != cpu_signature():
        return None
    return binary


def find_tools() -> dict[str, str]:
    """cmake, compilers and a build tool, or PeerUnavailable naming what is missing."""
    return native_build.find_tools(SERVER, PeerUnavailable)


def build_server(
    force: bool = False,
    jobs: int = 2,
    version: str = LLAMA_CPP_PYTHON,
    log: Callable[[str], None] | None = None,
    progress_stream=None,
    variant: str = "",
) -> Path:
    """Build llama-server from llama-cpp-python `version`'s vendored llama.cpp (unless a
    finished build for this CPU is installed and not `force`); returns the binary.
    `variant`: "" (stock) or NO_AMX."""
    from adaspec.store.atomic import atomic_dir, write_json

    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    if not force and (found := built_server(version, variant)) is not None:
        return found
    options = (*CMAKE_OPTIONS, *VARIANT_OPTIONS[variant])
    tools = find_tools()
    work = work_dir(version, variant)
    build = work / "build"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    src, commit = native_build.fetch_source("llama-cpp-python", version, "llama.cpp", work,
                                            SERVER, say, PeerUnavailable)
    log_path = work / "build.log"
    what = f"{SERVER} ({variant} build)" if variant else SERVER
    bar = native_build.Progress(f"building {what} (llama.cpp {commit[:10]} from "
                                f"llama-cpp-python {version}, {jobs} jobs; log {log_path})",
                                progress_stream)
    code, generator = native_build.cmake_build(tools, src, build, options, [SERVER], jobs,
                                               bar, log_path, work / "no-git")
    built = next((p for p in (build / "bin" / SERVER, build / SERVER) if p.is_file()), None)
    if code != 0 or built is None:
        raise PeerUnavailable(
            f"building {SERVER} failed ({native_build.log_tail(log_path) or f'exit code {code}'}); "
            f"full log: "
            f"{log_path} (run `adaspec bench build-peers` again to resume)"
        )
    seconds = round(time.monotonic() - t0, 1)
    with atomic_dir(server_dir(version, variant)) as tmp:
        (tmp / "bin").mkdir()
        shutil.copy2(built, tmp / "bin" / SERVER)
        write_json(tmp / BUILD_INFO, {
            "peer": SERVER, "variant": variant or "stock", "llama_cpp_python": version,
            "llama_cpp_commit": commit,
            **native_build.build_record(options, generator, tools, seconds),
        })
    shutil.rmtree(work, ignore_errors=True)
    say(f"{what}: built in {seconds / 60:.1f} min -> {server_binary(version, variant)}")
    return server_binary(version, variant)


def ensure_server(log: Callable[[str], None] | None = None, variant: str = "") -> Path:
    """The llama-server binary, built first when there is none for this CPU (a bench method
    that needs it builds it on first use)."""
    found = built_server(variant=variant)
    if found is not None:
        return found
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    why = "built for another CPU" if build_info(variant=variant) is not None else "not built yet"
    what = f"{SERVER} ({variant} build)" if variant else SERVER
    say(f"{what}: {why}; building it now (about 10 minutes on 2 cores; once)")
    return build_server(log=say, variant=variant)
