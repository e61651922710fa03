"""ik_llama.cpp built for this CPU (`backends/ik/build.py`): the build with a fake cmake, the
choice of library the binding loads, and `adaspec runtime build --if-possible`."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from adaspec.backends.ik import backend as ikllama
from adaspec.backends.ik import build as ik_build
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
from adaspec.cli import main
from adaspec.store import native_build

from .build_helpers import install_fake_tools

VERSION = "9.9.9"

# Configuring succeeds; building prints ninja's progress and writes both libraries, or fails
# when FAKE_CMAKE_FAIL is set.
FAKE_CMAKE = """#!/bin/sh
case " $* " in
  *" --build "*)
    build="$2"
    echo "[1/4] Building C object ggml.c.o"
    if [ -n "$FAKE_CMAKE_FAIL" ]; then echo "iqk_mul_mat.cpp:1: error: broken"; exit 2; fi
    echo "[4/4] Linking CXX shared library src/libllama.so"
    mkdir -p "$build/src" "$build/ggml/src"
    echo llama > "$build/src/libllama.so"; echo ggml > "$build/ggml/src/libggml.so" ;;
  *) echo "-- Configuring done" ;;
esac
"""


# The shape of the kernels file the source patches edit: a one-row shortcut before the
# repacked k-quant kernels (left alone), two inside them, one after them (left alone); the
# first load of a block in the repacked Q4_K and Q6_K kernels (where the prefetch goes); the
# Q4_K kernel's loop over groups of 4 rows (where the two-group pass goes first); the Q5_K
# kernel after it and the x86 kernel table (where the AMX kernel and its dispatch go).
KQUANTS = """#include "iqk_gemm_kquants.h"
#include <cstring>
#ifdef IQK_IMPLEMENT
template <int nrc_y> void before() { if constexpr (nrc_y == 1) { a(); } }
static void mul_mat_q2_k_r4_q8_k(int n) {
    if constexpr (nrc_y == 1) { d4 = d4 * s; }
    if constexpr (nrc_y == 1) { one(); } else { many(); }
}
template <int nrc_y>
static void mul_mat_q4_k_r4_q8_k(int n) {
    for (int ix = 0; ix < nrc_x; ix += 4) {
        const block_q4_k_r4 * iq4 = (const block_q4_k_r4 *)((const char *)vx + (ix+0)*bx);
        for (int ibl = 0; ibl < nbl; ++ibl) {
            auto dl = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)iq4[ibl].d));
        }
    }
}
template <int nrc_y>
static void mul_mat_q5_k_r4_q8_k(int n) {
}
template <int nrc_y>
static void mul_mat_q6_k_r4_q8_k(int n) {
    for (int ix = 0; ix < nrc_x; ix += 4) {
        const block_q6_k_r4 * iq6 = (const block_q6_k_r4 *)((const char *)vx + (ix+0)*bx);
        for (int ibl = 0; ibl < nbl; ++ibl) {
            auto dl = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)iq6[ibl].d));
        }
    }
}
template <typename Dequantizer> void set_functions(std::array<mul_mat_t, 8>& funcs) {
    if constexpr (nrc_y == 1) { b(); }
}
bool iqk_set_kernels_kquants(int typeA, std::array<mul_mat_t, 8>& kernels, mul_mat_t& func16) {
    switch (typeA) {
        case GGML_TYPE_Q4_K_R4:
            IQK_SET_MUL_MAT_FUNCTIONS(mul_mat_q4_k_r4_q8_k, kernels)
            break;
    }
}
#endif
"""

# The shapes of the kernels' header and of ik's driver that the AMX patch edits: the driver's
# plain and fused (gate and up) products, each with its 16-row loop, and MulMat::prepare.
KQUANTS_HEADER = f"""#pragma once
#include "iqk_common.h"
{ik_amx_patch.DECLARE_AFTER}void iqk_gemm_q8kv_fa(int D);
"""
DRIVER = """struct MulMat {
    std::array<mul_mat_t, IQK_MAX_NY> funcs = {};
    mul_mat_t func16 = nullptr;
    inline void mul_mat_NxM(int n, const void * vx, size_t bx, DataInfo& info, int nrc_x, int ny) {
        if (func16 && nrc_y >= 16) {
            func16(n, vx, bx, info, nrc_x);
        }
    }
    inline void mul_mat_up_gate_NxM(int n, DataInfo& info, int nrc_x, int nrc_y) {
        float tmp[k_x_step*16];
        auto process = [&tmp](mul_mat_t func, const DataInfo& this_info, int ix, int nx, int ny) {};
        if (func16 && nrc_y >= 16) {
                    process(func16, this_info, ix, this_nrc_x, 16);
        }
    }
};
bool MulMat::prepare(int typeA, int typeB, int ne00, MulMat& mm, int Ny) {
    switch (typeA) {
        case GGML_TYPE_Q4_K_R4:
            return iqk_set_kernels_kquants(ne00, typeA, typeB, mm.funcs, mm.func16);
    }
}
bool MulMat::prepare(int typeA, int typeB, int ne00, MulMat& m, int /*Ny*/) {
            return iqk_set_kernels_kquants(ne00, typeA, typeB, m.funcs, m.func16);
}
"""

# The shape of the flash-attention kernels the second patch edits: compute_helper (its group
# loop cut at the last row's last cell, then the rows left over) and another kernel's loop.
FA_TEMPLATES = "struct FlashMS {};\n" + ik_tree_patch._EDITS[-1][1] + (
    "template <int Dk, int Dv, int q_step, int k_step, typename KHelper, typename VHelper, "
    "typename KQHelper>\n") + """void compute_helper(KHelper& kh, int nq1, int nk1) {
    for (int i1 = 0; i1 < nq1/q_step; ++i1) {
        fms.init_qstep();
        kh.reset_block();
        vh.reset_block();
#ifdef __aarch64__
        KQHelper::convert(q_step, stride_q, q, q_f16);
#endif
        auto mr = mask;
        auto Mc = (const uint16_t *)(mr + (q_step - 1)*stride_m);
        int ik = nk1 - k_step;
        for (; ik >=0 && Mc[ik] != 0; ik -= k_step);
        ik += k_step;
        for (int k1 = 0; k1 < ik/k_step; ++k1) {
            group();
        }
    }
    if (n_left > 0) {
        auto mr = mask;
        for (int k1 = 0; k1 < nk1/k_step; ++k1) {
            left();
        }
    }
}
void iqk_flash_helper(int nq1) {
    if (nq1 == 12) {
        // Special case: TG for GLM-4.5/4.6
        twelve();
    }
}
void compute_helper_q() {
            int ik = nk1 - k_step;
            for (; ik >=0 && Mc[ik] != 0; ik -= k_step);
            ik += k_step;
            for (int k1 = 0; k1 < ik/k_step; ++k1) {
                other();
            }
}
"""


FA_IMPL = "#pragma once\n\n#include <cstdint>\n\nbool iqk_flash_attn_impl(int type_k);\n"

# The shape of the CPU backend file the huge-pages patch edits: its first include, the
# buffer's allocation and what follows it.
BACKEND = (ik_hugepages_patch.INCLUDE_AFTER + '#include "ggml-alloc.h"\n\n'
           + "static void * alloc(size_t size) {\n" + ik_hugepages_patch.ALLOC
           + "\n    return init(data, size);\n}\n")


def _regions_sources() -> dict[str, str]:
    """The files the regions, features and tree patches edit, each holding their anchors
    among other lines (an anchor two use, once; the tree patch's in the regions patch's text
    come with it, its kernel anchor with `FA_TEMPLATES`)."""
    out: dict[str, str] = {}
    placed = "".join(text for *_, text, _ in ik_regions_patch._EDITS)
    anchors = [(path, anchor) for path, anchor, *_ in
               (*ik_regions_patch._EDITS, *ik_features_patch._EDITS, *ik_tree_patch._EDITS)
               if path != ik_tree_patch.FILES[0] and anchor not in placed]
    for path, anchor in anchors:
        if anchor not in out.get(path, ""):
            out[path] = out.get(path, "// other code\n") + anchor + "// more code\n"
    return out


def _fake_sdist(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    root = f"ik_llama_cpp_python-{VERSION}"
    with tarfile.open(folder / f"{root}.tar.gz", "w:gz") as tar:
        for name, data in {
            f"{root}/vendor/ik_llama.cpp/CMakeLists.txt": b"project(fake)\n",
            f"{root}/vendor/ik_llama.cpp/{ik_build.ONE_ROW_FILE}": KQUANTS.encode(),
            f"{root}/vendor/ik_llama.cpp/{ik_flash_patch.FILE}":
                (FA_TEMPLATES + ik_head_sizes_patch.SIGNATURE).encode(),
            **{f"{root}/vendor/ik_llama.cpp/{ik_head_sizes_patch.DIR}/iqk_fa_{k}_{v}.cpp":
               b"// kernels\n" for k, v in ((64, 64), (96, 96), (128, 128), (576, 512))},
            f"{root}/vendor/ik_llama.cpp/{ik_flash_patch.IMPL}": FA_IMPL.encode(),
            f"{root}/vendor/ik_llama.cpp/{ik_hugepages_patch.FILE}": BACKEND.encode(),
            f"{root}/vendor/ik_llama.cpp/{ik_amx_patch.HEADER}": KQUANTS_HEADER.encode(),
            f"{root}/vendor/ik_llama.cpp/{ik_amx_patch.DRIVER}": DRIVER.encode(),
            **{f"{root}/vendor/ik_llama.cpp/{path}": text.encode()
               for path, text in _regions_sources().items()},
            f"{root}/.git/modules/vendor/ik_llama.cpp/HEAD": b"fedcba9876543210\n",
        }.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def fake_tools(tmp_path, monkeypatch):
    bin_dir = install_fake_tools(tmp_path, monkeypatch, FAKE_CMAKE, "ninja")
    _fake_sdist(ik_build.work_dir(VERSION) / "download")
    return bin_dir


def test_a_failed_build_leaves_nothing_used_and_a_finished_one_is_found(fake_tools,
                                                                       monkeypatch):
    monkeypatch.setenv("FAKE_CMAKE_FAIL", "1")
    out = io.StringIO()
    with pytest.raises(ik_build.IkBuildError) as err:
        ik_build.build_native(VERSION, log=lambda m: None, progress_stream=out)
    assert "iqk_mul_mat.cpp:1: error: broken" in str(err.value)
    assert "adaspec runtime build" in str(err.value) and "\n" not in str(err.value)
    assert ik_build.native_library(VERSION) is None
    assert not ik_build.runtime_dir(VERSION).exists()
    assert (ik_build.work_dir(VERSION) / "ik_llama.cpp" / "CMakeLists.txt").is_file()
    assert "configuring" in out.getvalue()

    monkeypatch.delenv("FAKE_CMAKE_FAIL")
    lib = ik_build.build_native(VERSION, log=lambda m: None, progress_stream=out)
    assert lib == ik_build.runtime_dir(VERSION) / "lib" / "libllama.so"
    assert ik_build.native_library(VERSION) == lib
    assert (lib.parent / "libggml.so").read_text() == "ggml\n"
    info = ik_build.build_info(VERSION)
    assert info["commit"] == "fedcba9876543210" and "-DGGML_NATIVE=ON" in info["cmake_options"]
    assert "-DCMAKE_INSTALL_RPATH=$ORIGIN" in info["cmake_options"]
    assert info["patches"] == list(ik_build.patches()) and info["one_row_shortcuts_guarded"] == 2
    assert ik_head_sizes_patch.NAME in info["patches"]
    assert info["head_size_kernels_left_out"] == 2
    assert ik_flash_patch.NAME in info["patches"] and info["flash_attention_loops_patched"] == 3
    assert ik_prefetch_patch.NAME in info["patches"] and info["prefetching_kernels"] == 2
    assert ik_hugepages_patch.NAME in info["patches"]
    assert info["patches"].index(ik_two_groups_patch.NAME) > info["patches"].index(
        ik_prefetch_patch.NAME)
    assert ik_build.current(info)
    assert not ik_build.work_dir(VERSION).exists()
    # a build for another CPU is not used
    info["cpu_signature"] = {**info["cpu_signature"], "flags_sha256": "other"}
    (ik_build.runtime_dir(VERSION) / ik_build.BUILD_INFO).write_text(json.dumps(info))
    assert ik_build.native_library(VERSION) is None


def _kernels_file(src: Path) -> Path:
    """The fake kernels file both k-quant patches edit, written under `src`."""
    assert ik_build.ONE_ROW_FILE == ik_prefetch_patch.FILE
    path = src / ik_build.ONE_ROW_FILE
    path.parent.mkdir(parents=True)
    path.write_text(KQUANTS)
    return path


def _refuses(apply, src: Path, path: Path, error: type[Exception], other: str,
             match: str) -> None:
    """A patch given another version's file (`other`) raises `error` naming what it lacks,
    and one given no file raises it saying the source is unreadable."""
    path.write_text(other)
    with pytest.raises(error, match=match):
        apply(src)
    path.unlink()
    with pytest.raises(error, match="unreadable"):
        apply(src)


def test_the_source_patch_guards_only_the_repacked_kernels_shortcuts(tmp_path):
    path = _kernels_file(tmp_path)
    assert ik_build.patch_source(tmp_path) == 2
    text = path.read_text()
    assert text.startswith(ik_build.ONE_ROW_MACRO)  # off unless the compiler is told
    assert text.count(ik_build.ONE_ROW_GUARDED) == 2
    assert text.count(ik_build.ONE_ROW_SHORTCUT) == 2  # the one before, the one after
    before, _, rest = text.partition("static void mul_mat_q2_k_r4_q8_k(")
    assert ik_build.ONE_ROW_SHORTCUT in before and ik_build.ONE_ROW_GUARDED not in before
    assert ik_build.patch_source(tmp_path) == 2 and path.read_text() == text  # resumed build
    # another version's source: an error naming it, never a silent unpatched build
    _refuses(ik_build.patch_source, tmp_path, path, ik_build.IkBuildError,
             KQUANTS.replace("mul_mat_q2_k_r4_q8_k", "mul_mat_q2_k_r8_q8_k"),
             "lacks the repacked k-quant kernels")


def test_the_prefetch_patch_fetches_two_blocks_ahead_in_the_q4_k_and_q6_k_kernels(tmp_path):
    path = _kernels_file(tmp_path)
    assert ik_prefetch_patch.apply(tmp_path) == 2
    text = path.read_text()
    helper = text.index("static inline void adaspec_prefetch_block(")
    assert helper < text.index("static void mul_mat_q4_k_r4_q8_k(")  # declared before use
    body = text[helper:text.index("static void mul_mat_q4_k_r4_q8_k(")]
    assert "if constexpr (nrc_y > 1)" in body  # a lone row is left alone
    assert "(block + 2)" in body and "_mm_prefetch(" in body
    for blocks, load in (("iq4", "iq4[ibl].d"), ("iq6", "iq6[ibl].d")):
        call = f"adaspec_prefetch_block<nrc_y>({blocks} + ibl);"
        assert text.count(call) == 1 and text.index(call) < text.index(load)  # before the load
    assert "mul_mat_q2_k_r4_q8_k(int n) {\n    if constexpr" in text  # other kernels untouched
    assert ik_prefetch_patch.apply(tmp_path) == 2 and path.read_text() == text  # resumed build
    # another version's source: an error naming what is missing, never a silent build
    _refuses(ik_prefetch_patch.apply, tmp_path, path, ik_prefetch_patch.PatchError,
             KQUANTS.replace("iq6[ibl].d", "iq6[ibl].dm"), "expected one `auto dl")


def test_the_two_group_patch_runs_before_the_q4_k_kernels_own_loop(tmp_path):
    path = _kernels_file(tmp_path)
    with pytest.raises(ik_two_groups_patch.PatchError, match="prefetch patch goes first"):
        ik_two_groups_patch.apply(tmp_path)
    ik_prefetch_patch.apply(tmp_path)
    ik_two_groups_patch.apply(tmp_path)
    text = path.read_text()
    helper = text.index("static int adaspec_q4_k_r4_two_groups(")
    kernel = text.index("static void mul_mat_q4_k_r4_q8_k(")
    # after the prefetch helper it calls, before the kernel that calls it
    assert text.index("static inline void adaspec_prefetch_block(") < helper < kernel
    body = text[helper:kernel]
    assert "if constexpr (nrc_y == 1) {\n        return 0;" in body  # a lone row: the kernel's
    assert "nrc_x - nrc_x % 8" in body  # a last group of 4 rows: the kernel's
    assert body.count("adaspec_prefetch_block<nrc_y>(iqg[g] + ibl);") == 1
    loop = "for (int ix = adaspec_q4_k_r4_two_groups<nrc_y>(n, vx, bx, info, nrc_x); ix < nrc_x;"
    assert text.count(loop) == 1 and kernel < text.index(loop)
    assert text.count("for (int ix = 0; ix < nrc_x; ix += 4)") == 1  # the Q6_K one's
    ik_two_groups_patch.apply(tmp_path)
    assert path.read_text() == text  # resumed build
    _refuses(ik_two_groups_patch.apply, tmp_path, path, ik_two_groups_patch.PatchError,
             ik_prefetch_patch.patch_text(KQUANTS)[0].replace("ix += 4", "ix += 8"),
             "expected one `for \\(int ix = 0")


def test_the_wide_patch_takes_both_loops_on_avx512_and_leaves_the_rest_to_the_kernels(tmp_path):
    path = _kernels_file(tmp_path)
    ik_prefetch_patch.apply(tmp_path)
    with pytest.raises(ik_wide_patch.PatchError, match="two-group patch goes first"):
        ik_wide_patch.apply(tmp_path)
    ik_two_groups_patch.apply(tmp_path)
    ik_wide_patch.apply(tmp_path)
    text = path.read_text()
    kernel = text.index("static void mul_mat_q4_k_r4_q8_k(")
    q6 = text.index("static void mul_mat_q6_k_r4_q8_k(")
    # after the two-group walk it falls back to, before the kernels that call it
    assert text.index("static int adaspec_q4_k_r4_two_groups(") < text.index(
        "static int adaspec_q4_k_r4_wide(") < kernel
    helpers = text[text.index(f"adaspec ({ik_wide_patch.NAME})"):kernel]
    assert helpers.count("#ifdef HAVE_FANCY_SIMD") == 3  # the 512-bit walks on AVX-512 only
    assert helpers.count("if constexpr (nrc_y <= 8)") == 2  # longer calls: the walk before
    # and a switch per CPU: no more rows than the library was told (0: the kernels' own walk)
    assert helpers.count("if (nrc_y <= adaspec_wide_rows) return adaspec_q") == 2
    switch = text.index("int adaspec_wide_rows = 8;")
    assert switch < text.index("#ifdef IQK_IMPLEMENT") < kernel  # file scope, C linkage
    assert 'extern "C" {' in text[:switch]
    assert f'visibility("default"))) void {ik_wide_patch.SETTER}(int rows)' in text
    assert "return adaspec_q4_k_r4_two_groups<nrc_y>(" in helpers
    assert helpers.count("return nrc_x8;") == 2  # a last group of 4 rows: the kernel's
    fetch = helpers[helpers.index("static inline void adaspec_wide_prefetch("):]
    fetch = fetch[:fetch.index("\n}\n")]
    assert "_mm_prefetch(" in fetch and "nrc_y" not in fetch  # a lone row fetches ahead too
    q4_loop = "for (int ix = adaspec_q4_k_r4_wide<nrc_y>(n, vx, bx, info, nrc_x); ix < nrc_x;"
    q6_loop = "for (int ix = adaspec_q6_k_r4_wide<nrc_y>(n, vx, bx, info, nrc_x); ix < nrc_x;"
    assert text.count(q4_loop) == 1 and kernel < text.index(q4_loop) < q6
    assert text.count(q6_loop) == 1 and q6 < text.index(q6_loop)
    assert "for (int ix = 0; ix < nrc_x; ix += 4)" not in text
    assert "adaspec_q4_k_r4_two_groups<nrc_y>(n, vx, bx, info, nrc_x); ix" not in text
    ik_wide_patch.apply(tmp_path)
    assert path.read_text() == text  # resumed build
    two_groups = ik_two_groups_patch.patch_text(ik_prefetch_patch.patch_text(KQUANTS)[0])
    _refuses(ik_wide_patch.apply, tmp_path, path, ik_wide_patch.PatchError,
             two_groups.replace("const block_q6_k_r4 * iq6", "const block_q6_k_r8 * iq6"),
             "expected one `for \\(int ix = 0")
    _refuses(ik_wide_patch.apply, tmp_path, path, ik_wide_patch.PatchError,
             two_groups.replace("#ifdef IQK_IMPLEMENT\n", ""), "expected one `#ifdef IQK_IMPL")


def test_the_amx_patch_adds_its_kernel_after_the_q4_k_one_and_a_path_for_every_16_rows(tmp_path):
    path = _kernels_file(tmp_path)
    header, driver = tmp_path / ik_amx_patch.HEADER, tmp_path / ik_amx_patch.DRIVER
    header.write_text(KQUANTS_HEADER)
    driver.write_text(DRIVER)
    ik_prefetch_patch.apply(tmp_path)
    ik_two_groups_patch.apply(tmp_path)
    ik_wide_patch.apply(tmp_path)
    ik_amx_patch.apply(tmp_path)
    text = path.read_text()
    q4, q5 = (text.index(f"static void mul_mat_q{k}_k_r4_q8_k(") for k in (4, 5))
    amx = text.index("static void mul_mat_q4_k_r4_q8_k_amx(")
    assert q4 < amx < q5  # after the kernel it calls for the rows left over
    body = text[amx:q5]
    assert "if defined(__AMX_INT8__)" in text[q4:amx]  # compiled only for an AMX target
    assert "pinned_rest(mul_mat_q4_k_r4_q8_k<16>, n, vx, bx, info, tiled" in body
    # the Q6_K one after the x86 Q6_K kernel it calls, before the kernel tables
    q6, tables = (text.index(f) for f in ("static void mul_mat_q6_k_r4_q8_k(",
                                           "template <typename Dequantizer> void set_functions("))
    q6_amx = text.index("static void mul_mat_q6_k_r4_q8_k_amx(")
    assert q6 < q6_amx < tables
    assert "pinned_rest(mul_mat_q6_k_r4_q8_k<16>, n, vx, bx, info, tiled" in text[q6_amx:tables]
    assert "inline mul_mat_t rows_kernel(int typeA)" in text[q6_amx:tables]
    assert "ARCH_REQ_XCOMP_PERM" in text and '"ADASPEC_IK_AMX"' in text
    # the entry points the driver calls: outside the x86 kernels' namespace, before the end
    rows = text.index("mul_mat_t adaspec_amx_rows(int typeA) {")
    assert text.index("void adaspec_amx_order(const DataInfo& info, int n, int nrc_y) {") > rows
    assert rows > text.index("bool iqk_set_kernels_kquants(") and text.endswith("}\n\n#endif\n")
    assert "use_q4_k_r4" not in text  # ik's 16-row slot keeps the pinned kernel
    assert text.index("#include <sys/syscall.h>") < text.index("template <int nrc_y>")
    assert text.count("#include <sys/syscall.h>") == 1
    declared = header.read_text()
    assert declared.index("mul_mat_t adaspec_amx_rows(int typeA);") > declared.index(
        "bool iqk_set_kernels_kquants(")
    d = driver.read_text()
    member = d.index("mul_mat_t adaspec_rows = nullptr;")
    assert d.index("mul_mat_t func16 = nullptr;") < member < d.index("inline void mul_mat_NxM(")
    # both products take every 16 rows first, ordered once; the fused one in its process
    plain, fused = (d.index("if (adaspec_rows && nrc_y - info.cur_y >= 16)", at)
                    for at in (0, d.index("mul_mat_up_gate_NxM")))
    assert plain < d.index("if (func16 && nrc_y >= 16)") < d.index("mul_mat_up_gate_NxM")
    assert "adaspec_rows(n, vx, bx, info, nrc_x);" in d[plain:d.index("mul_mat_up_gate_NxM")]
    assert fused < d.index("if (func16 && nrc_y >= 16)", fused)
    assert d.count("adaspec_amx_order(info, n, rows);") == 2
    assert "process(adaspec_rows, this_info, ix, this_nrc_x, rows);" in d[fused:]
    # the fused product's activated gate values: room for every row, not 16
    assert "float tmp[k_x_step*16];" not in d
    assert "adaspec_tmp.resize(k_x_step*std::max(16, nrc_y - info.cur_y));" in d
    # set with the x86 k-quant kernels only (not the other prepare's `m.`)
    assert d.count("mm.adaspec_rows = adaspec_amx_rows(typeA);\n            return "
                   "iqk_set_kernels_kquants(ne00, typeA, typeB, mm.funcs, mm.func16);") == 1
    assert "m.adaspec_rows" not in d.replace("mm.adaspec_rows", "")
    ik_amx_patch.apply(tmp_path)
    assert (path.read_text(), header.read_text(), driver.read_text()) == (text, declared, d)
    _refuses(ik_amx_patch.apply, tmp_path, path, ik_amx_patch.PatchError,
             KQUANTS.replace("static void mul_mat_q5_k_r4_q8_k(", "static void q5("),
             "expected one `template <int nrc_y>`")
    path.write_text(KQUANTS)
    driver.write_text(DRIVER.replace("        if (func16 && nrc_y >= 16) {\n", "", 1))
    with pytest.raises(ik_amx_patch.PatchError, match="the plain and the fused product"):
        ik_amx_patch.apply(tmp_path)


def test_the_head_size_patch_keeps_the_models_kernels_and_declines_the_rest(tmp_path,
                                                                             monkeypatch):
    folder = tmp_path / ik_head_sizes_patch.DIR
    folder.mkdir(parents=True)
    header = tmp_path / ik_head_sizes_patch.HEADER
    header.write_text("// templates\n" + ik_head_sizes_patch.SIGNATURE)
    kernels = {(k, v): folder / f"iqk_fa_{k}_{v}.cpp"
               for k, v in ((64, 64), (96, 96), (128, 128), (192, 128), (576, 512))}
    for path in kernels.values():
        path.write_text("IQK_FA_CASE(...) { /* the whole template */ }\n")
    (folder / "iqk_fa_templates.cpp").write_text("// not a kernel file\n")
    assert ik_head_sizes_patch.apply(tmp_path) == 3
    for size, path in kernels.items():
        text = path.read_text()
        if size in ik_head_sizes_patch.KEPT:
            assert "the whole template" in text
        else:  # a stub under the same name and signature that declines
            assert f"IQK_FA_CASE({path.stem}) {{" in text and "return false;" in text
            assert ik_head_sizes_patch.SIGNATURE.rstrip("\n") in text
            assert "iqk_fa_templates.h" not in text.split("\n", 2)[2]  # nothing heavy
    assert ik_head_sizes_patch.left_out(tmp_path) == 3
    before = {p: p.read_text() for p in kernels.values()}
    assert ik_head_sizes_patch.apply(tmp_path) == 3  # resumed build
    assert {p: p.read_text() for p in kernels.values()} == before
    # the default, and every kernel on request (then the patch is not in the build's record)
    assert ik_head_sizes_patch.NAME in ik_build.patches()
    monkeypatch.setenv(ik_head_sizes_patch.ENV, "all")
    assert ik_head_sizes_patch.NAME not in ik_build.patches()
    monkeypatch.setenv(ik_head_sizes_patch.ENV, "some")
    with pytest.raises(ik_build.IkBuildError, match="ADASPEC_IK_HEAD_SIZES must be"):
        ik_build.patches()
    # another version: another signature, or no kernel for a kept size
    header.write_text("#define IQK_FA_CASE(name) bool name(int type)\n")
    with pytest.raises(ik_head_sizes_patch.PatchError, match="signature"):
        ik_head_sizes_patch.apply(tmp_path)
    header.write_text(ik_head_sizes_patch.SIGNATURE)
    kernels[(128, 128)].unlink()
    with pytest.raises(ik_head_sizes_patch.PatchError, match="no kernel file for head size 128"):
        ik_head_sizes_patch.apply(tmp_path)
    header.unlink()
    with pytest.raises(ik_head_sizes_patch.PatchError, match="unreadable"):
        ik_head_sizes_patch.apply(tmp_path)


def test_the_huge_pages_patch_advises_big_buffers_before_their_first_touch(tmp_path):
    path = tmp_path / ik_hugepages_patch.FILE
    path.parent.mkdir(parents=True)
    path.write_text(BACKEND)
    ik_hugepages_patch.apply(tmp_path)
    text = path.read_text()
    include = text.index("#include <sys/mman.h>")
    assert text.index(ik_hugepages_patch.INCLUDE_AFTER) < include < text.index("ggml-alloc.h")
    advice = text.index("madvise((void *)first, last - first, MADV_HUGEPAGE);")
    # after the allocation and its failure check, before the buffer is handed out (touched)
    assert text.index("if (data == NULL)") < advice < text.index("return init(data, size);")
    assert "size >= ((size_t)4 << 20)" in text  # small buffers are left alone
    assert text.count("#ifdef __linux__") == 2  # madvise is Linux's
    ik_hugepages_patch.apply(tmp_path)
    assert path.read_text() == text  # resumed build
    _refuses(ik_hugepages_patch.apply, tmp_path, path, ik_hugepages_patch.PatchError,
             BACKEND.replace("void * data = malloc(size);", "void * data = calloc(1, size);"),
             "expected one `void \\* data = malloc")


def test_the_flash_attention_patch_skips_hidden_blocks_and_attends_rows_apart(tmp_path):
    path, impl = tmp_path / ik_flash_patch.FILE, tmp_path / ik_flash_patch.IMPL
    path.parent.mkdir(parents=True)
    path.write_text(FA_TEMPLATES)
    impl.write_text(FA_IMPL)
    assert ik_flash_patch.apply(tmp_path) == 3  # two group loops, one of rows left over
    text, shared = path.read_text(), impl.read_text()
    assert "Mc[ik] != 0" not in text  # no range cut by the last row's cells any more
    assert text.count("ADASPEC_SKIP_MASKED(q_step)") == 2
    assert text.count("ADASPEC_SKIP_MASKED(n_left)") == 1
    assert text.count("ADASPEC_SKIP_MASKED(1)") == 1  # rows of different sequences, apart
    # the mask readers once, in the header the kernel's caller includes too
    assert "static inline bool adaspec_block_masked" not in text
    assert shared.index("#include <cstdint>") < shared.index("bool adaspec_block_masked")
    assert shared.index("bool adaspec_block_masked") < shared.index("bool adaspec_rows_apart")
    assert shared.index("bool adaspec_rows_apart") < shared.index("bool iqk_flash_attn_impl(")
    including = text.index('#include "iqk/iqk_flash_impl.h"')
    assert including < text.index("void compute_helper(") < text.index("adaspec_rows_apart(mask")
    # 5-7 rows (a token's query heads) in one pass, before the helper's own row counts
    assert text.index("nq1 > 4 && nq1 < 8") < text.index("if (nq1 == 12)")
    assert ik_flash_patch.apply(tmp_path) == 3 and path.read_text() == text  # resumed build
    assert impl.read_text() == shared
    impl.write_text(FA_IMPL.replace("#include <cstdint>", "#include <stdint.h>"))
    with pytest.raises(ik_flash_patch.PatchError, match="iqk_flash_impl.h: no `#include"):
        ik_flash_patch.apply(tmp_path)
    impl.write_text(FA_IMPL)
    # another version's source: an error naming what is missing, never a silent build
    path.write_text(FA_TEMPLATES.replace("void compute_helper(", "void compute_rows("))
    with pytest.raises(ik_flash_patch.PatchError, match="no compute_helper"):
        ik_flash_patch.apply(tmp_path)
    path.write_text(FA_TEMPLATES.replace("Mc[ik] != 0", "Mc[ik] == 1"))
    with pytest.raises(ik_flash_patch.PatchError, match="block loops"):
        ik_flash_patch.apply(tmp_path)
    path.write_text(FA_TEMPLATES.replace("if (nq1 == 12)", "if (nq1 == 16)"))
    with pytest.raises(ik_flash_patch.PatchError, match="row counts"):
        ik_flash_patch.apply(tmp_path)


def test_the_regions_patch_places_by_sequence_stores_by_rows_and_attends_every_row_alike(
        tmp_path):
    texts = _regions_sources()
    for path, text in texts.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert ik_regions_patch.apply(tmp_path) == len(ik_regions_patch._EDITS) + 1
    got = {path: (tmp_path / path).read_text() for path in texts}
    llama = got["src/llama.cpp"]
    # placement before the usual search, the cells handed to the graph, the switch exported
    assert llama.index("return adaspec_place(cache, batch);") < llama.index("uint32_t n_tested")
    assert "adaspec_inp_cells" in llama and "int adaspec_kv_regions(" in llama
    assert "int adaspec_kv_seq_copy(" in llama  # a shared prefix copied into a region
    store = got["src/llama-build-context.cpp"]
    assert store.index("ggml_set_rows") < store.index("    if (k_cur) {")  # before the run copy
    # one path for every masked call, before the pinned kernel's shape-dependent ones (the
    # lone row's cells split among threads, a prompt's trimmed blocks): a sequence's rows
    # together a query head a thread, other rows a (row, key/value head) a thread
    fa = got["ggml/src/iqk/iqk_flash_attn.cpp"]
    one_path = fa.index("if (neq3 == 1 && rk2 > 1 && rk2 == rv2 && mask && !sinks) {")
    assert one_path < fa.index("    int first_k = 0, last_k = nek1;")
    assert "together ? (long)neq2 : (long)n*nek2" in fa[one_path:]
    assert "static bool" not in fa and "uint64_t" not in fa
    assert ik_regions_patch.apply(tmp_path) == len(ik_regions_patch._EDITS) + 1  # resumed
    assert {path: (tmp_path / path).read_text() for path in texts} == got
    (tmp_path / "src/llama.cpp").write_text("// another version\n")
    texts["src/llama.cpp"] = "// another version\n"
    with pytest.raises(ik_regions_patch.PatchError, match="src/llama.cpp: the anchor"):
        ik_regions_patch.patch_files(texts)


def test_the_features_patch_copies_the_final_states_beside_the_logits_when_asked(tmp_path):
    texts = _regions_sources()
    for path, text in texts.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert ik_regions_patch.apply(tmp_path) == len(ik_regions_patch._EDITS) + 1  # both apply
    assert ik_features_patch.apply(tmp_path) == len(ik_features_patch._EDITS) + 1
    got = {path: (tmp_path / path).read_text() for path in texts}
    assert "bool adaspec_features = false;" in got["src/llama-context.h"]
    llama = got["src/llama.cpp"]
    assert "|| lctx.adaspec_features; // adaspec" in llama  # room for the states
    assert "if (cparams.embeddings || has_mtp || lctx.adaspec_features) {" in llama  # found
    assert "switch (lctx.adaspec_features ? LLAMA_POOLING_TYPE_NONE" in llama  # copied, per row
    assert 'extern "C" LLAMA_API void adaspec_features(' in llama
    assert ik_features_patch.apply(tmp_path) == len(ik_features_patch._EDITS) + 1  # resumed
    assert {path: (tmp_path / path).read_text() for path in texts} == got
    texts["src/llama.cpp"] = "// another version\n"
    with pytest.raises(ik_features_patch.PatchError, match="src/llama.cpp: the anchor"):
        ik_features_patch.patch_files(texts)


def test_the_tree_patch_places_a_tree_after_its_root_and_hides_what_is_no_ancestor(tmp_path):
    texts = _regions_sources()
    texts[ik_tree_patch.FILES[0]] = FA_TEMPLATES
    for path, text in texts.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    with pytest.raises(ik_tree_patch.PatchError, match="the anchor"):  # regions first
        ik_tree_patch.apply(tmp_path)
    ik_regions_patch.apply(tmp_path)
    assert ik_tree_patch.apply(tmp_path) == len(ik_tree_patch._EDITS) + 1
    got = {path: (tmp_path / path).read_text() for path in texts}
    llama = got["src/llama.cpp"]
    # a tree's token i in the root's cell + i, never in a spare cell
    assert "const llama_pos at = tree ? batch.pos[0] + (llama_pos)i : pos;" in llama
    assert "cell < 0 && !tree && tested < cache.size" in llama
    # the mask hides the call's cells of non-ancestors, after the usual mask is built
    assert llama.index("for (int64_t a = j; a >= 0; a = parent[a]) seen[a] = 1;") > \
        llama.index('printf("set_inputs(mask1)')
    assert "int adaspec_tree(" in llama and "int adaspec_kv_tree_keep(" in llama
    assert "adaspec_copy_cell(ctx, base + keep[d], base + 1 + d);" in llama
    # a block hiding cells sums the weights cell by cell; a full one as the kernel does
    fa = got[ik_tree_patch.FILES[0]]
    assert "for (int l = 0; l < k_step; ++l) s += cache[k_step*j + l];" in fa
    assert "update_S(j, vk);\n            }" in fa
    assert ik_tree_patch.apply(tmp_path) == len(ik_tree_patch._EDITS) + 1  # resumed
    assert {path: (tmp_path / path).read_text() for path in texts} == got


def test_a_build_made_without_the_patch_is_built_again(fake_tools):
    lib = ik_build.build_native(VERSION, log=lambda m: None, progress_stream=io.StringIO())
    info = ik_build.build_info(VERSION)
    del info["patches"]  # as `adaspec runtime build` wrote it before the patch
    (ik_build.runtime_dir(VERSION) / ik_build.BUILD_INFO).write_text(json.dumps(info))
    assert ik_build.native_library(VERSION) == lib  # still loadable meanwhile
    assert not ik_build.current(ik_build.build_info(VERSION))
    _fake_sdist(ik_build.work_dir(VERSION) / "download")
    ik_build.build_native(VERSION, log=lambda m: None, progress_stream=io.StringIO())
    assert ik_build.current(ik_build.build_info(VERSION))


def _fake_native_build(monkeypatch, tmp_path) -> Path:
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    folder = ik_build.runtime_dir(ikllama.IK_VERSION)
    (folder / "lib").mkdir(parents=True)
    (folder / "lib" / "libllama.so").write_text("x")
    (folder / ik_build.BUILD_INFO).write_text(json.dumps(
        {"cpu_signature": native_build.cpu_signature()}))
    return folder / "lib" / "libllama.so"


def test_the_binding_is_pointed_at_a_native_build_unless_told_otherwise(monkeypatch,
                                                                        tmp_path):
    for name in (ikllama.LIB_PATH_ENV, ik_build.BUILD_ENV):
        monkeypatch.setenv(name, "x")  # recorded as it was, so teardown restores it
        monkeypatch.delenv(name)
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    assert ikllama._choose_build() == "wheel"  # none built yet
    lib = _fake_native_build(monkeypatch, tmp_path)
    monkeypatch.setenv(ik_build.BUILD_ENV, "wheel")
    assert ikllama._choose_build() == "wheel"
    assert ikllama.LIB_PATH_ENV not in os.environ
    monkeypatch.delenv(ik_build.BUILD_ENV)
    assert ikllama._choose_build() == "native"
    assert os.environ[ikllama.LIB_PATH_ENV] == str(lib)  # inherited by child processes
    assert ikllama._choose_build() == "native"  # what such a child process sees
    monkeypatch.setenv(ikllama.LIB_PATH_ENV, "/somewhere/libllama.so")
    assert ikllama._choose_build() == "custom"
    monkeypatch.delenv(ikllama.LIB_PATH_ENV)
    monkeypatch.setenv(ik_build.BUILD_ENV, "fast")
    with pytest.raises(ik_build.IkBuildError, match="must be 'native' or 'wheel'"):
        ikllama._choose_build()


def test_setup_goes_on_with_the_wheel_when_the_build_cannot_run(monkeypatch, tmp_path,
                                                               capsys):
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))

    def no_tools(what, error):
        raise error(f"building {what} needs cmake: apt-get install cmake build-essential")

    monkeypatch.setattr(native_build, "find_tools", no_tools)
    assert main(["runtime", "build", "--if-possible"]) == 0
    assert "the prebuilt ik_llama.cpp wheel stays in use" in capsys.readouterr().err
    assert main(["runtime", "build"]) == 2  # asked for outright: an error
    assert "needs cmake" in capsys.readouterr().err


def test_a_native_build_that_does_not_load_falls_back_to_the_wheel(monkeypatch, tmp_path):
    """A broken native library (here: not a library at all) costs a one-line warning, not
    the runtime: the wheel's library is loaded instead."""
    import subprocess
    import sys

    pytest.importorskip("ik_llama_cpp")
    _fake_native_build(monkeypatch, tmp_path)
    env = {k: v for k, v in os.environ.items()
           if k not in (ikllama.LIB_PATH_ENV, ik_build.BUILD_ENV)}
    code = ("from adaspec.backends.ik.backend import library\n"
            "print(library().adaspec_build)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "wheel"
    assert "built for this CPU does not load" in done.stderr
    assert "adaspec runtime build --force" in done.stderr


@pytest.mark.parametrize("switch, env, patch", [
    (ikllama.multi_sequence_flash, ikllama.FLASH_ENV, ik_flash_patch.NAME),
    (ikllama.kv_regions, ikllama.REGIONS_ENV, ik_regions_patch.NAME),
], ids=["flash attention", "regions"])
def test_a_multi_sequence_kernel_change_needs_the_patched_library(monkeypatch, switch, env,
                                                                   patch):
    from adaspec.errors import AdaspecError

    class Api:
        adaspec_patches = ik_build.PATCHES

    monkeypatch.delenv(env, raising=False)
    assert switch(Api())
    # a build from before the patch (the wheel has none)
    Api.adaspec_patches = tuple(p for p in ik_build.PATCHES if p != patch)
    assert not switch(Api())
    Api.adaspec_patches = ik_build.PATCHES
    monkeypatch.setenv(env, "off")
    assert not switch(Api())
    monkeypatch.setenv(env, "yes")
    with pytest.raises(AdaspecError, match=f"{env} must be 'auto' or 'off'"):
        switch(Api())


def test_the_wide_walk_runs_where_it_pays_and_the_user_can_say(monkeypatch):
    """On for an Intel CPU, off for an AMD one (measured slower there), None for a build
    without the switch; ADASPEC_IK_WIDE=on/off overrides, anything else is an error."""
    from adaspec.errors import AdaspecError

    class Api:
        adaspec_patches = ik_build.PATCHES

    monkeypatch.delenv(ikllama.WIDE_ENV, raising=False)
    for vendor, wide in (("GenuineIntel", True), ("AuthenticAMD", False), ("", False)):
        monkeypatch.setattr("adaspec.store.native_build.cpu_vendor", lambda v=vendor: v)
        assert ikllama.wide_walk(Api()) is wide
    for value, wide in (("on", True), ("off", False), ("ON ", True)):
        monkeypatch.setenv(ikllama.WIDE_ENV, value)
        assert ikllama.wide_walk(Api()) is wide
    Api.adaspec_patches = tuple(p for p in ik_build.PATCHES if p != ik_wide_patch.NAME)
    assert ikllama.wide_walk(Api()) is None  # an older build, or the wheel
    Api.adaspec_patches = ik_build.PATCHES
    monkeypatch.setenv(ikllama.WIDE_ENV, "fast")
    with pytest.raises(AdaspecError, match=f"{ikllama.WIDE_ENV} must be 'auto', 'on' or 'off'"):
        ikllama.wide_walk(Api())


HARNESS = r"""
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
typedef uint16_t ggml_half;
%s
static bool plain(const char * mr, int stride_m, int nq, int k_step) {  // one half at a time
    for (int j = 0; j < nq; ++j)
        for (int l = 0; l < k_step; ++l)
            if (((const uint16_t *)(mr + j*stride_m))[l] != 0xFC00) return false;
    return true;
}
int main() {
    std::mt19937 rng(7);
    const int nk = 512, rows = 8;
    static uint16_t mask[rows*nk];
    long checked = 0, hidden = 0, apart = 0;
    for (int trial = 0; trial < 4000; ++trial) {
        for (auto & m : mask) m = 0xFC00;
        int open = rng() %% 4;  // visible cells: none, one, a run, or scattered
        for (int j = 0; j < rows; ++j) {
            if (open == 1) mask[j*nk + rng() %% nk] = 0;
            int a = rng() %% nk;
            if (open == 2) for (int l = a; l < nk && l < a + 40; ++l) mask[j*nk + l] = 0;
            if (open == 3)
                for (int l = 0; l < nk; ++l)
                    if (rng() %% 97 == 0) mask[j*nk + l] = (rng() & 1) ? 0 : 0xFBFF;
        }
        for (int k_step : {32, 64, 128})
            for (int nq = 1; nq <= rows; ++nq)
                for (int b = 0; b < nk/k_step; ++b) {
                    const char * mr = (const char *)(mask + b*k_step);
                    bool got = adaspec_block_masked(mr, nk*2, nq, k_step);
                    if (got != plain(mr, nk*2, nq, k_step)) { printf("differs\n"); return 1; }
                    ++checked; hidden += got;
                }
        for (int k_step : {32, 128}) {  // rows apart: at most half of the group's reading
            long all = 0, own = 0;
            for (int b = 0; b < nk/k_step; ++b) {
                int need = 0;
                for (int j = 0; j < rows; ++j)
                    need += !plain((const char *)(mask + j*nk + b*k_step), nk*2, 1, k_step);
                all += need > 0;
                own += need;
            }
            if (adaspec_rows_apart(mask, nk*2, rows, nk, k_step) != (2*own <= all*rows) ||
                adaspec_rows_apart(mask, 0, rows, nk, k_step)) {
                printf("rows apart differs\n"); return 1;
            }
            apart += 2*own <= all*rows;
        }
    }
    printf("%%ld %%ld %%ld\n", checked, hidden, apart);
    return 0;
}
"""


def test_the_patch_reads_a_hidden_block_as_a_plain_reading_of_the_mask_does(tmp_path):
    """The patch's C++ helpers, compiled: it must call a block hidden exactly when every half
    of every row's mask there is -inf (a wrong answer would change the attention's output,
    or slow it), on thousands of masks with cells open singly, in runs and scattered; and
    call rows apart exactly when a plain count of their blocks says so."""
    import shutil
    import subprocess

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    helpers = ik_flash_patch.SHARED
    src = tmp_path / "masked.cpp"
    src.write_text(HARNESS % helpers)
    exe = tmp_path / "masked"
    subprocess.run([cxx, "-O2", "-march=native", "-std=c++17", str(src), "-o", str(exe)],
                   check=True, capture_output=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
    checked, hidden, apart = map(int, out.stdout.split())
    assert checked > 100_000 and 0 < hidden < checked  # both answers were exercised
    assert 0 < apart < 2 * 4000  # rows apart and together, both seen
