"""How close ik_llama.cpp's matmuls run to this CPU's int8 limit (issue 33: is there room
left in the kernels for 8 requests' rounds and for prompt chunks?).

Two measurements in one run, then their ratio:

- the limit: a compiled loop of independent `vpdpbusd` (int8 dot products, the instruction
  the repacked k-quant kernels are built on), 256-bit and 512-bit, per core; times the
  cores. On the Zen 5 of session 15 a 512-bit `vpdpbusd` issued at half the rate of a
  256-bit one, so 512-bit kernels do the same work per second there;
- the calls: one sequence after 300 cached tokens, a prompt chunk of 256 rows (logits of the
  last row) and a decoding round of 8 rows (logits of every row), as adaspec runs them
  (`ik_raw.py`: repacked weights, flash attention).

Multiply-accumulates per call = rows x (parameters - the embedding table - the output matrix)
+ rows with logits x the output matrix's elements (from the GGUF's tensors; a model with tied
embeddings multiplies by its table): attention's own products are left out (a few percent at
these lengths).

    .venv/bin/python experiments/int8_roofline.py \
        --out experiments/results/int8-roofline-epyc/roofline.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from ik_raw import Context, load_model

from adaspec.backends.gguf import gguf_backend_args
from adaspec.backends.ik.backend import library
from adaspec.backends.weights import llama_threads
from adaspec.store.catalog import TARGET_DEFAULT

LOOP = r"""
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
                          return t.tv_sec + t.tv_nsec * 1e-9; }
#define Y(r) "vpdpbusd %%ymm14, %%ymm15, %%ymm" #r "\n\t"
#define Z(r) "vpdpbusd %%zmm14, %%zmm15, %%zmm" #r "\n\t"
#define TWELVE(I) I(0) I(1) I(2) I(3) I(4) I(5) I(6) I(7) I(8) I(9) I(10) I(11)
#define RUN(name, I) { long n = 50000000; double t = now(); for (long i = 0; i < n; i++) { \
    __asm__ volatile(TWELVE(I) ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", \
                     "xmm7", "xmm8", "xmm9", "xmm10", "xmm11"); } \
    printf("%s %.4f\n", name, 12.0 * n / (now() - t) / 1e9); }
int main(void) { RUN("ymm", Y) RUN("zmm", Z) return 0; }
"""


def vnni_rate() -> dict[str, float] | None:
    """G vpdpbusd per second on one core, 256-bit and 512-bit; None without a compiler or
    AVX512-VNNI."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or "avx512_vnni" not in Path("/proc/cpuinfo").read_text():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "loop.c", Path(tmp) / "loop"
        src.write_text(LOOP)
        subprocess.run([cc, "-O2", "-march=native", "-o", str(exe), str(src)], check=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {line.split()[0]: float(line.split()[1]) for line in out.splitlines()}


def time_calls(target: str, repeats: int) -> dict:
    import gguf

    path = gguf_backend_args(target, llama_threads(), 8192, library)[0]
    sizes = {t.name: int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors}
    table = sizes["token_embd.weight"]
    head = sizes.get("output.weight", table)
    api, lib, model = load_model(target, True)
    n_params = int(lib.llama_model_n_params(model))
    per_row = n_params - table - sizes.get("output.weight", 0)
    ctx = Context(lib, model, flash=True, sequences=1, n_ctx=4096)
    rng = random.Random(0)
    ctx.fill(0, 300, rng)
    calls = {}
    for name, rows, every in (("prompt chunk of 256", 256, False), ("round of 8", 8, True)):
        times = []
        for _ in range(repeats + 1):
            ids = [rng.randrange(1000, 30000) for _ in range(rows)]
            seconds, _ = ctx.decode([(0, 300 + i, t) for i, t in enumerate(ids)],
                                    want={rows - 1}, every_row=every)
            ctx.roll_back()
            times.append(seconds)
        macs = rows * per_row + (rows if every else 1) * head
        ms = 1000 * statistics.median(times[1:])
        calls[name] = {"rows": rows, "ms": round(ms, 1), "gmac": round(macs / 1e9, 2),
                       "gmac_per_s": round(macs / ms / 1e6, 1)}
    ctx.close()
    lib.llama_free_model(model)
    return {"n_params": n_params, "matmul_params_per_row": per_row, "output_params": head,
            "calls": calls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=TARGET_DEFAULT)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    threads = llama_threads()
    rate = vnni_rate()
    record: dict = {"target": args.target, "threads": threads, "cpus": os.cpu_count(),
                    "vpdpbusd_g_per_s_per_core": rate}
    record.update(time_calls(args.target, args.repeats))
    if rate:
        # 32 (ymm) or 64 (zmm) multiply-accumulates an instruction, on every thread's core
        peak = max(32 * rate["ymm"], 64 * rate["zmm"]) * threads
        record["peak_gmac_per_s"] = round(peak, 1)
        for call in record["calls"].values():
            call["share_of_peak"] = round(call["gmac_per_s"] / peak, 3)
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
