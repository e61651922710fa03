"""ik_llama.cpp's own flash-attention kernels compiled for the head sizes adaspec's models use.

Why: `ggml/src/iqk/fa/` holds one file per (key, value) head size (64, 96, 128, 192, 256, 320,
512, 576), each instantiating the whole kernel template for every cache type and step; they
were 438 of the 680 CPU-seconds of the native build on the 2-vCPU Xeon (`.ninja_log`, 45-65
s each), the biggest share of `make setup`'s wait. The built-in models have heads of 64 (the
0.5B draft, SmolLM2) and 128 (the 1.5B target; most Llama, Mistral and Qwen models too). The
other files become a function that declines (`return false`), which is how the dispatcher in
`iqk_mul_mat.cpp` already answers an unknown size: ggml's own flash attention runs those
heads instead, correct and slower (and without `ik/patches/flash.py`'s multi-sequence loop).
`ADASPEC_IK_HEAD_SIZES=all` compiles every file (the patch is then left out of the build's
record, so a build made either way is rebuilt when the other is asked for).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from adaspec.backends.ik.source import PatchError

NAME = "fa-head-sizes-64-128"
ENV = "ADASPEC_IK_HEAD_SIZES"
DIR = "ggml/src/iqk/fa"
KEPT = ((64, 64), (128, 128))
MARK = "adaspec (fa-head-sizes)"
FILE_NAME = re.compile(r"iqk_fa_(\d+)_(\d+)\.cpp")
# the kernels' signature in the pinned source (`IQK_FA_CASE` in iqk_fa_templates.h): a
# source whose macro differs would link a stub the dispatcher does not call
HEADER = f"{DIR}/iqk_fa_templates.h"
SIGNATURE = """#define IQK_FA_CASE(name) bool name(int int_type_k, int int_type_v,int nq,int nk,\\
                         int stride_q, int stride_k, int stride_v, int stride_m, int stride_qkv,\\
                         const float * q, const void * k, const void * v, const void * mask,\\
                         float scale, float softcap,\\
                         float       * qkv, const float * sinkf, float * M, float * S)
"""
STUB = """// {mark}: not compiled for this head size; the dispatcher's `false` runs
// ggml's own flash attention instead (adaspec's `backends/ik/patches/head_sizes.py`)
#include "iqk/iqk_config.h"

#if defined IQK_IMPLEMENT && defined GGML_IQK_FLASH_ATTENTION

{signature}
IQK_FA_CASE({name}) {{
    (void)int_type_k; (void)int_type_v; (void)nq; (void)nk; (void)stride_q; (void)stride_k;
    (void)stride_v; (void)stride_m; (void)stride_qkv; (void)q; (void)k; (void)v; (void)mask;
    (void)scale; (void)softcap; (void)qkv; (void)sinkf; (void)M; (void)S;
    return false;
}}

#endif
"""


def wanted() -> bool:
    """Whether this build leaves out the other head sizes (unless ADASPEC_IK_HEAD_SIZES=all)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value not in ("", "all", "used"):
        raise PatchError(f"{ENV} must be 'used' (64 and 128, the default) or 'all', "
                         f"got {value!r}")
    return value != "all"


def apply(src: Path) -> int:
    """Replace the kernel files of the head sizes not kept by a declining stub (again on a
    resumed build: no change); returns how many files were left out."""
    from adaspec.store.atomic import write_text

    folder = src / DIR
    try:
        header = (src / HEADER).read_text()
        files = sorted(p for p in folder.iterdir() if FILE_NAME.fullmatch(p.name))
    except OSError as exc:
        raise PatchError(f"unreadable source ({exc})") from None
    if SIGNATURE not in header:
        raise PatchError(f"{HEADER}: the flash-attention kernels' signature (IQK_FA_CASE) "
                         "is not the one this adaspec expects")
    sizes = {tuple(int(g) for g in FILE_NAME.fullmatch(p.name).groups()): p  # type: ignore[union-attr]
             for p in files}
    missing = [f"{k}_{v}" for k, v in KEPT if (k, v) not in sizes]
    if missing:
        raise PatchError(f"{DIR}: no kernel file for head size {', '.join(missing)}")
    left_out = 0
    for size, path in sizes.items():
        if size in KEPT:
            continue
        left_out += 1
        stub = STUB.format(mark=MARK, signature=SIGNATURE.rstrip("\n"), name=path.stem)
        if path.read_text() != stub:
            write_text(path, stub)
    return left_out


def left_out(src: Path) -> int:
    """How many kernel files of `src` an earlier `apply` replaced."""
    try:
        return sum(MARK in p.read_text() for p in (src / DIR).iterdir()
                   if FILE_NAME.fullmatch(p.name))
    except OSError:
        return 0
