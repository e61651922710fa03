"""Forward time of the target and the draft for n = 1, 2, 4, 8, 16 new tokens, per quantization.

Each model is loaded through the store (quantized caches included), a 200-token context is
prefilled, then n random tokens are scored and the cache rolled back, `--repeats` times;
the median is reported. Writes forward_times.json and forward_times.md to --out.

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/fastcpu_forward.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from adaspec.backends.torch.backend import TorchBackend
from adaspec.lab.bench.machine import describe_machine
from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT
from adaspec.store.model_store import load_model
from adaspec.store.quant import QUANT_MODES

SIZES = (1, 2, 4, 8, 16)


def time_forwards(backend: TorchBackend, context: int, repeats: int) -> dict[int, float]:
    gen = torch.Generator().manual_seed(0)
    backend.reset()
    backend.forward(torch.randint(0, 1000, (context,), generator=gen))
    out: dict[int, float] = {}
    for n in SIZES:
        times = []
        for _ in range(repeats + 1):  # the first call of each size warms up
            tokens = torch.randint(0, 1000, (n,), generator=gen)
            t0 = time.perf_counter()
            backend.forward(tokens)
            times.append(time.perf_counter() - t0)
            backend.truncate(context)
        out[n] = 1000 * statistics.median(times[1:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=f"{TARGET_DEFAULT},{DRAFT_DEFAULT}")
    ap.add_argument("--quants", default=",".join(QUANT_MODES))
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16",
                    help="activation / unquantized weight dtype (bfloat16, float32)")
    ap.add_argument("--no-row-invariant", action="store_true",
                    help="skip timing the quantized target with row-invariant attention")
    ap.add_argument("--out", default="experiments/results/fastcpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    models = args.models.split(",")
    for name in models:
        for quant in args.quants.split(","):
            t0 = time.perf_counter()
            loaded = load_model(name, dtype=args.dtype, quant=quant)
            load_s = time.perf_counter() - t0
            # A quantized target verifies with row-invariant attention (build.target_backend):
            # time it beside the batched kernel a draft uses.
            modes = ["batched"]
            if name == models[0] and quant != "none" and not args.no_row_invariant:
                modes.append("row-invariant")
            for attention in modes:
                backend = TorchBackend(loaded.model, name=name,
                                       row_invariant=attention == "row-invariant")
                ms = time_forwards(backend, args.context, args.repeats)
                rows.append({"model": name, "quant": quant, "attention": attention,
                             "load_s": round(load_s, 1),
                             "weight_bytes": backend.bytes_per_forward,
                             "ms": {str(n): round(v, 1) for n, v in ms.items()}})
                print(f"{name} {quant} {attention}: load {load_s:.1f}s " +
                      " ".join(f"n={n}:{v:.0f}ms" for n, v in ms.items()), flush=True)
            del loaded, backend
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.dtype == "bfloat16" else f"-{args.dtype}"
    meta = {"machine": describe_machine(), "dtype": args.dtype, "threads": args.threads,
            "context": args.context, "repeats": args.repeats, "torch": torch.__version__}
    (out / f"forward_times{suffix}.json").write_text(
        json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"# Forward time per call ({args.dtype}, median of {args.repeats}, context "
        f"{args.context}, {args.threads} threads)", "",
        f"Machine: {meta['machine']}", "",
        "| model | quant | attention | weights MB | n=" + " | n=".join(map(str, SIZES)) +
        " | GB/s at n=1 | load s |",
        "| --- | --- | --- | ---: | " + " | ".join("---:" for _ in SIZES) + " | ---: | ---: |",
    ]
    for r in rows:
        gbs = r["weight_bytes"] / (r["ms"]["1"] / 1000) / 1e9
        lines.append(
            f"| {r['model']} | {r['quant']} | {r['attention']} | {r['weight_bytes'] / 1e6:.0f} | " +
            " | ".join(f"{r['ms'][str(n)]:.0f} ms" for n in SIZES) +
            f" | {gbs:.1f} | {r['load_s']} |"
        )
    (out / f"forward_times{suffix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
