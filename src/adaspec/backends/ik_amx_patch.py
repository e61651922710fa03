"""The repacked Q4_K kernel on AMX tiles, for calls of 16 rows at a time on a CPU with AMX.

Why: on an Intel Xeon with AMX (2 vCPUs) a round of one token for each of 8 requests cost
2.2 single-token passes, a prompt token about as much as a round's row: the repacked Q4_K
kernel (`mul_mat_q4_k_r4_q8_k` in `ggml/src/iqk/iqk_gemm_kquants.cpp`, most of a call's time)
multiplies with 256-bit int8 dot products, where one AMX tile instruction multiplies 16 rows
of activations by 16 weight rows over 64 quants. `ik_amx.cpp` computes the kernel's integer
sums (scale x quants, per weight row and half sub-block) with tiles and leaves its float code
as it is, so every output is bit for bit the kernel's and a row's logits do not depend on
which kernel scored it (the backend's rows-alike check and the smoke test's block-against-
lone comparison hold). Compiled only where the compiler targets AMX (`GGML_NATIVE` on such
a CPU); at run time the process asks Linux for the tile state, and without it (or with
`ADASPEC_IK_AMX=off`) the kernels are the pinned ones. Only calls of 16 rows at a time take it
(ik's `func16`: prompt chunks, blocks of 16 and more); rounds of 8 requests and fewer rows
keep the pinned kernel: reading their weights from memory once per call, the tile kernel
measured no faster there in the library (faster on weights in cache).
"""

from __future__ import annotations

from pathlib import Path

from adaspec.backends import ik_prefetch_patch
from adaspec.backends.ik_source import PatchError, patch_file

NAME = "k-quant-amx"
FILE = ik_prefetch_patch.FILE
MARK = "adaspec_amx"
ENV = "ADASPEC_IK_AMX"  # OFF: the pinned kernels even where AMX is there (read by ik_amx.cpp)
OFF = "off"

# the x86 Q4_K kernel ends where the Q5_K one begins: the AMX kernel goes between them
AFTER_KERNEL = "template <int nrc_y>\nstatic void mul_mat_q5_k_r4_q8_k("
DISPATCH = ("        case GGML_TYPE_Q4_K_R4:\n"
            "            IQK_SET_MUL_MAT_FUNCTIONS(mul_mat_q4_k_r4_q8_k, kernels)\n")
HOOK = ("#ifdef ADASPEC_AMX_Q4K\n"
        "            adaspec_amx::use_q4_k_r4(kernels, func16);\n"
        "#endif\n")
KERNEL = (Path(__file__).parent / "ik_amx.cpp").read_text
# the kernel's headers, after the file's own first include (outside any namespace)
FIRST_INCLUDE = '#include "iqk_gemm_kquants.h"\n'
INCLUDES = "#include <sys/syscall.h>\n#include <unistd.h>\n#include <cstdlib>\n#include <vector>\n"


def patch_text(text: str) -> str:
    """The kernels file with the AMX kernel and its dispatch (unchanged when already there)."""
    if MARK in text:
        return text
    if FIRST_INCLUDE not in text:
        raise PatchError(f"{FILE}: no `{FIRST_INCLUDE.strip()}`")
    if text.count(AFTER_KERNEL) != 1:
        raise PatchError(f"{FILE}: expected one `{AFTER_KERNEL.splitlines()[1]}`, "
                         f"found {text.count(AFTER_KERNEL)}")
    kernel_at = text.index(AFTER_KERNEL)
    dispatch_at = text.find(DISPATCH, kernel_at)  # the x86 table, after the x86 kernels
    if dispatch_at < 0:
        raise PatchError(f"{FILE}: no x86 `case GGML_TYPE_Q4_K_R4:` kernel table after the "
                         "repacked kernels")
    end = dispatch_at + len(DISPATCH)
    text = text[:end] + HOOK + text[end:]
    text = text[:kernel_at] + KERNEL() + "\n" + text[kernel_at:]
    return text.replace(FIRST_INCLUDE, FIRST_INCLUDE + INCLUDES, 1)


def apply(src: Path) -> None:
    """Patch the unpacked source in place (atomically)."""
    patch_file(src, FILE, patch_text)
