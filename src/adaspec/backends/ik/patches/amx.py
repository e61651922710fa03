"""The repacked Q4_K and Q6_K kernels on AMX tiles, for calls of many rows on a CPU with AMX.

Why: on an Intel Xeon with AMX (2 vCPUs) a prompt token costs about as much as a round's
row, and most of a prompt chunk's time is the repacked Q4_K and Q6_K kernels
(`mul_mat_q4_k_r4_q8_k`, `mul_mat_q6_k_r4_q8_k` in `ggml/src/iqk/iqk_gemm_kquants.cpp`),
which multiply with int8 dot products on vector registers, where one AMX tile instruction
multiplies 16 rows of activations by 16 weight rows over 64 quants. `ik_amx.cpp` (Q4_K) and
`ik_amx_q6.cpp` (Q6_K) compute the kernels' integer sums (scale x quants, per weight row and
half or parity of the sub-blocks) with tiles and leave their float code as it is, so every
output is bit for bit the kernel's and a row's logits do not depend on which kernel scored it
(the backend's rows-alike check and the smoke test's block-against-lone comparison hold).

ik's driver (`ggml/src/iqk/iqk_mul_mat.cpp`) calls a kernel for each 16 activation rows of
each 64 weight rows, so a 16-row tile kernel prepared the same weights (quants x scale bits)
and ordered the same activations again for every 16 rows of a prompt chunk. This patch gives
the driver a path for every 16 rows of a call at once (`MulMat::adaspec_rows`, in the plain
product and in the fused gate-and-up one): the activations are ordered once per call and
thread, the weights prepared once per call. Rows beyond a multiple of 16 keep the pinned
kernels, as do calls of fewer rows (rounds of 8 requests read their weights from memory once
per call, where the tile kernel measured no faster) and Q6_K calls of 16 rows.

Compiled only where the compiler targets AMX (`GGML_NATIVE` on such a CPU); at run time the
process asks Linux for the tile state, and without it (or with `ADASPEC_IK_AMX=off`) the
kernels are the pinned ones.
"""

from __future__ import annotations

from pathlib import Path

from adaspec.backends.ik.patches import prefetch as ik_prefetch_patch
from adaspec.backends.ik.source import PatchError, patch_file

NAME = "k-quant-amx-2"
FILE = ik_prefetch_patch.FILE
HEADER = "ggml/src/iqk/iqk_gemm_kquants.h"
DRIVER = "ggml/src/iqk/iqk_mul_mat.cpp"
MARK = "adaspec_amx"
ENV = "ADASPEC_IK_AMX"  # OFF: the pinned kernels even where AMX is there (read by ik_amx.cpp)
OFF = "off"

# --- the kernels file: each tile kernel after the x86 kernel it calls for the rows it leaves,
# two functions at the end
# the x86 Q4_K kernel ends where the Q5_K one begins, the Q6_K one where the kernel tables begin
AFTER_KERNEL = "template <int nrc_y>\nstatic void mul_mat_q5_k_r4_q8_k("
AFTER_Q6_KERNEL = "template <typename Dequantizer> void set_functions("
KERNEL = (Path(__file__).parent / "ik_amx.cpp").read_text
Q6_KERNEL = (Path(__file__).parent / "ik_amx_q6.cpp").read_text
# the kernel's headers, after the file's own first include (outside any namespace)
FIRST_INCLUDE = '#include "iqk_gemm_kquants.h"\n'
INCLUDES = ("#include <sys/syscall.h>\n#include <unistd.h>\n#include <cstdlib>\n"
            "#include <cstring>\n#include <vector>\n")
EXPORTS = """
// adaspec (k-quant-amx-2): the tile kernel for ik's driver, where this CPU has one
mul_mat_t adaspec_amx_rows(int typeA) {
#ifdef ADASPEC_AMX_Q4K
    return adaspec_amx::rows_kernel(typeA);
#else
    (void)typeA;
    return nullptr;
#endif
}

void adaspec_amx_order(const DataInfo& info, int n, int nrc_y) {
#ifdef ADASPEC_AMX_Q4K
    adaspec_amx::order(info, n, nrc_y);
#else
    (void)info; (void)n; (void)nrc_y;
#endif
}

"""
FILE_END = "#endif\n"  # IQK_IMPLEMENT's

# --- the kernels header: their declarations
DECLARE_AFTER = ("bool iqk_set_kernels_kquants(int ne00, int typeA, int typeB, "
                 "std::array<mul_mat_t, IQK_MAX_NY>& kernels, mul_mat_t& func16);\n")
DECLARATIONS = ("\n// adaspec (k-quant-amx-2): a kernel taking every 16 activation rows of a "
                "call at once (nullptr\n// where there is none), after `adaspec_amx_order` "
                "took those rows\nmul_mat_t adaspec_amx_rows(int typeA);\n"
                "void adaspec_amx_order(const DataInfo& info, int n, int nrc_y);\n")

# --- the driver: a member, set with the k-quant kernels, taken first by both products
MEMBER_AFTER = "    mul_mat_t func16 = nullptr;\n"
MEMBER = ("    mul_mat_t adaspec_rows = nullptr;  // adaspec (k-quant-amx-2): every 16 rows at "
          "once\n")
PREPARE = "            return iqk_set_kernels_kquants(ne00, typeA, typeB, mm.funcs, mm.func16);\n"
PREPARED = "            mm.adaspec_rows = adaspec_amx_rows(typeA);\n"
SIXTEEN = "        if (func16 && nrc_y >= 16) {\n"
ROWS_PLAIN = """        if (adaspec_rows && nrc_y - info.cur_y >= 16) {  // adaspec (k-quant-amx-2)
            int rows = (nrc_y - info.cur_y)/16*16;
            adaspec_amx_order(info, n, rows);
            adaspec_rows(n, vx, bx, info, nrc_x);
            info.cur_y += rows;
            if (info.cur_y == nrc_y) return;
        }
"""
ROWS_FUSED = """        if (adaspec_rows && nrc_y - info.cur_y >= 16) {  // adaspec (k-quant-amx-2)
            int rows = (nrc_y - info.cur_y)/16*16;
            adaspec_amx_order(info, n, rows);
            for (int ix = 0; ix < nrc_x; ix += k_x_step) {
                auto this_info = info;
                this_info.s += ix;
                int this_nrc_x = ix + k_x_step <= nrc_x ? k_x_step : nrc_x - ix;
                process(adaspec_rows, this_info, ix, this_nrc_x, rows);
            }
            info.cur_y += rows;
            if (info.cur_y == nrc_y) return;
        }
"""
# the fused product's buffer of activated gate values: room for every row of a call
TMP = "        float tmp[k_x_step*16];\n"
TMP_ROWS = ("        static thread_local std::vector<float> adaspec_tmp;  // adaspec "
            "(k-quant-amx-2): every row\n"
            "        adaspec_tmp.resize(k_x_step*std::max(16, nrc_y - info.cur_y));\n"
            "        float * tmp = adaspec_tmp.data();\n")


def _one(text: str, file: str, anchor: str) -> int:
    if text.count(anchor) != 1:
        raise PatchError(f"{file}: expected one `{anchor.strip().splitlines()[0]}`, "
                         f"found {text.count(anchor)}")
    return text.index(anchor)


def patch_text(text: str) -> str:
    """The kernels file with the AMX kernels and their two entry points (unchanged when already
    there)."""
    if MARK in text:
        return text
    if FIRST_INCLUDE not in text:
        raise PatchError(f"{FILE}: no `{FIRST_INCLUDE.strip()}`")
    kernel_at = _one(text, FILE, AFTER_KERNEL)
    q6_kernel = text.find("static void mul_mat_q6_k_r4_q8_k(", kernel_at)
    q6_at = text.find(AFTER_Q6_KERNEL, q6_kernel)  # the first tables, after the x86 kernels
    if q6_kernel < 0 or q6_at < 0:
        raise PatchError(f"{FILE}: no `{AFTER_Q6_KERNEL}` after the x86 Q6_K kernel")
    if not text.endswith(FILE_END):
        raise PatchError(f"{FILE}: does not end with `{FILE_END.strip()}`")
    end = len(text) - len(FILE_END)
    text = text[:end] + EXPORTS + text[end:]
    text = text[:q6_at] + Q6_KERNEL() + "\n" + text[q6_at:]
    text = text[:kernel_at] + KERNEL() + "\n" + text[kernel_at:]
    return text.replace(FIRST_INCLUDE, FIRST_INCLUDE + INCLUDES, 1)


def patch_header(text: str) -> str:
    if "adaspec_amx_rows" in text:
        return text
    at = _one(text, HEADER, DECLARE_AFTER) + len(DECLARE_AFTER)
    return text[:at] + DECLARATIONS + text[at:]


def patch_driver(text: str) -> str:
    """ik's driver taking the tile kernel first for every 16 rows (both products)."""
    if "adaspec_rows" in text:
        return text
    at = _one(text, DRIVER, MEMBER_AFTER) + len(MEMBER_AFTER)
    text = text[:at] + MEMBER + text[at:]
    at = _one(text, DRIVER, PREPARE)
    text = text[:at] + PREPARED + text[at:]
    if text.count(SIXTEEN) != 2 or text.count(TMP) != 1:
        raise PatchError(f"{DRIVER}: expected the plain and the fused product's "
                         f"`{SIXTEEN.strip()}` and one `{TMP.strip()}`")
    plain = text.index(SIXTEEN)
    fused = text.index(SIXTEEN, plain + 1)
    tmp = text.index(TMP)
    if not plain < tmp < fused or "process(func16" not in text[fused:fused + 600]:
        raise PatchError(f"{DRIVER}: the fused product's 16-row loop is not where expected")
    text = text[:fused] + ROWS_FUSED + text[fused:]
    text = text[:tmp] + TMP_ROWS + text[tmp + len(TMP):]
    return text[:plain] + ROWS_PLAIN + text[plain:]


def apply(src: Path) -> None:
    """Patch the unpacked source in place (each file atomically)."""
    patch_file(src, FILE, patch_text)
    patch_file(src, HEADER, patch_header)
    patch_file(src, DRIVER, patch_driver)
