"""What the kernel drivers' scripts (ik_amx_kernel.py, ik_wide_kernel.py) share: unpack the
pinned ik_llama.cpp source, compile a driver `.cpp` beside this file with the (patched)
kernels file included and the native build's `libggml.so` linked, run it, and write its JSON
lines with the machine. Not a script of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from adaspec.backends.ik import backend as ikllama
from adaspec.backends.ik import build as ik_build
from adaspec.store import native_build

KERNELS = "ggml/src/iqk/iqk_gemm_kquants.cpp"


def unpack(work: Path, patch: Callable[[Path], None]) -> Path:
    """The source unpacked under `work` with `patch` applied to it: its kernels file."""
    if ik_build.native_library(ikllama.IK_VERSION) is None:
        sys.exit("no native ik_llama.cpp build for this CPU: run `adaspec runtime build`")
    work.mkdir(parents=True, exist_ok=True)
    src, _ = native_build.fetch_source(ik_build.PACKAGE, ikllama.IK_VERSION, "ik_llama.cpp",
                                       work, ik_build.WHAT, print)
    patch(src)
    return src / KERNELS


def build_and_run(driver_cpp: Path, kernels: Path, work: Path, defines: dict[str, Path],
                  argv: list[str], out: str | None, **report: object) -> None:
    """Compile `driver_cpp` with `kernels` (and any `defines`: macro -> file) included, run
    it with `argv`, print its JSON lines and write them to `out` (with the machine, the
    compile command, `report` and whether every output was bit for bit equal)."""
    lib = ik_build.native_library(ikllama.IK_VERSION)
    assert lib is not None  # (`unpack` said so)
    src = kernels.parents[3]
    driver = work / driver_cpp.stem
    compile_cmd = ["g++", "-O3", "-march=native", "-std=c++17", "-pthread",
                   f'-DIK_KERNELS_FILE="{kernels}"',
                   *(f'-D{name}="{path}"' for name, path in defines.items()),
                   *(f"-I{src / d}" for d in ("ggml/include", "ggml/src", "ggml/src/iqk")),
                   str(driver_cpp), "-o", str(driver),
                   f"-L{lib.parent}", "-lggml", f"-Wl,-rpath,{lib.parent}"]
    built = subprocess.run(compile_cmd, capture_output=True, text=True)
    if built.returncode != 0:
        sys.exit(f"compiling the driver failed:\n{built.stderr[-3000:]}")
    ran = subprocess.run([str(driver), *argv], capture_output=True, text=True)
    rows = [json.loads(line) for line in ran.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        print(row, flush=True)
    if ran.returncode != 0:
        sys.exit(f"the driver stopped ({ran.returncode}): {ran.stderr[-2000:]}")
    if out:
        result = {"machine": native_build.cpu_signature(), "compile": compile_cmd, **report,
                  "shapes": rows, "bit_for_bit": all(r["differ"] == 0 for r in rows)}
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
