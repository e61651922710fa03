"""Where a decode pass of the 1.5B goes on a GPU (issue 34: plain decoding at 3.4x its
floor). Random-init weights of the real shape, bf16, 512 cached tokens. Measures, in one
process, and writes decode_parts.{json,md} to --out:

- the static runtime's pass of n = 1, 4, 8 tokens (CUDA graphs; compiled where asked) with
  the cache sized as the bench sizes it (8192 positions: the fixed pass's mask and attention
  span every slot) and sized to the request (768), so the difference is attention over
  empty slots;
- the pass's kernels by GPU time (torch.profiler over the eager fixed pass), grouped;
- each linear map of a layer alone, replayed 28 times in a graph (what cuBLAS reaches on
  the weights' bytes), separate and fused (q/k/v in one, gate/up in one);
- attention alone over the spans, as the runtime calls it and with the query heads of a
  group folded into rows.

    PYTHONPATH=src python3 experiments/gpu_decode_parts.py --out $OUT
    PYTHONPATH=src python experiments/gpu_decode_parts.py --device cpu --tiny   # smoke
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_costs import add_common, curve, model_of, shapes_for, sync


def graph_ms(fn, device: str, inner: int, reps: int = 20) -> float:
    """ms of one `fn()` call: `inner` calls captured in one CUDA graph, replayed (launches
    cost what they cost inside a pass); plain timing on the CPU."""
    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return 1000 * (time.perf_counter() - t0) / inner
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    sync(device)
    return start.elapsed_time(end) / reps / inner


def kernel_table(backend, device: str, context: int) -> list[tuple[str, float, int]]:
    """(kernel group, GPU µs per pass, launches per pass) of one eager fixed pass of n=1."""
    backend.reset()
    backend.prefill(torch.randint(0, 1000, (context,)))
    one = torch.tensor([5])
    for _ in range(2):
        backend.forward(one)
        backend.truncate(context)
    sync(device)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    reps = 5
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            backend.forward(one)
            backend.truncate(context)
        sync(device)
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if device == "cuda" and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        key = ("gemm/gemv" if any(s in name for s in ("gemm", "gemv", "cutlass", "sm90",
                                                       "splitk", "matmul"))
               else "attention" if any(s in name for s in ("attention", "flash", "fmha",
                                                           "softmax", "bmm"))
               else "copy/index" if any(s in name for s in ("copy", "index", "scatter",
                                                            "gather", "cat", "fill"))
               else "reduce" if "reduce" in name
               else "elementwise" if "elementwise" in name or "vectorized" in name
               else e.name[:60])
        groups[key][0] += e.device_time_total if device == "cuda" else e.cpu_time_total
        groups[key][1] += 1
    rows = [(k, round(v[0] / reps, 1), v[1] // reps) for k, v in groups.items()]
    return sorted(rows, key=lambda r: -r[1])


def linear_parts(shape: dict, vocab: int, device: str, layers: int) -> dict[str, float]:
    """ms of one layer's linear maps at one token (each replayed `layers` times)."""
    h, m = shape["hidden_size"], shape["intermediate_size"]
    d = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * d
    x = torch.randn(1, 1, h, device=device, dtype=torch.bfloat16)
    xm = torch.randn(1, 1, m, device=device, dtype=torch.bfloat16)

    def lin(i, o, bias=False):
        return torch.nn.Linear(i, o, bias=bias, device=device, dtype=torch.bfloat16)

    q, k, v, o = lin(h, h, True), lin(h, kv, True), lin(h, kv, True), lin(h, h)
    g, u, dn = lin(h, m), lin(h, m), lin(m, h)
    qkv, gu, head = lin(h, h + 2 * kv, True), lin(h, 2 * m), lin(h, vocab)
    parts = {
        "q": lambda: q(x), "k": lambda: k(x), "v": lambda: v(x), "o": lambda: o(x),
        "gate": lambda: g(x), "up": lambda: u(x), "down": lambda: dn(xm),
        "qkv fused": lambda: qkv(x), "gate+up fused": lambda: gu(x),
    }
    out = {name: round(graph_ms(fn, device, layers), 4) for name, fn in parts.items()}
    out["lm_head"] = round(graph_ms(lambda: head(x), device, 4), 4)
    bytes_layer = 2 * (2 * h * h + 2 * h * kv + 3 * h * m)
    out["layer_bytes"] = bytes_layer
    return out


def attention_parts(shape: dict, device: str, spans: tuple[int, ...], layers: int
                    ) -> dict[str, float]:
    """ms of one layer's attention for one token over `spans` slots: as the runtime calls it
    (bool mask, grouped heads), and with a group's query heads folded into rows."""
    heads, kvh = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape["hidden_size"] // heads
    out = {}
    for span in spans:
        q = torch.randn(1, heads, 1, d, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, kvh, span, d, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = torch.zeros(1, span, dtype=torch.bool, device=device)
        mask[:, :513] = True
        fold_q = q.view(1, kvh, heads // kvh, d)
        out[f"sdpa gqa mask span={span}"] = round(graph_ms(
            lambda q=q, k=k, v=v, mask=mask: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=True), device, layers), 4)
        out[f"sdpa folded mask span={span}"] = round(graph_ms(
            lambda q=fold_q, k=k, v=v, mask=mask: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask), device, layers), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common(ap, "experiments/results/gpu-decode-parts")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--contexts", default="8192,768", help="cache sizes (positions)")
    ap.add_argument("--compile-sizes", default="1,4", help="sizes also timed compiled")
    args = ap.parse_args()

    from adaspec.backends.torch.static import static_backend

    device = args.device
    shapes, vocab = shapes_for(args.tiny)
    name = next(iter(shapes))
    shape = shapes[name]
    model = model_of(shape, vocab, device, torch.bfloat16)
    model.config.max_position_embeddings = 32768  # the real checkpoint's
    layers = shape["num_hidden_layers"]
    contexts = [int(c) for c in args.contexts.split(",")]
    rec: dict = {"machine": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                 "torch": torch.__version__, "model": name, "cached": args.context,
                 "command": "PYTHONPATH=src python3 experiments/gpu_decode_parts.py --out $OUT",
                 "note": "random-init weights of the real shape: costs, not outputs",
                 "pass_ms": {}, "kernels": {}}
    graphs = "cuda" if device == "cuda" else "eager"
    for mc in contexts:
        static = static_backend(model, name, device, max_context=mc, graphs=graphs)
        rec["pass_ms"][f"graphs, cache {mc}"] = {
            n: round(t, 3) for n, t in curve(static, device, args.reps, args.context,
                                            (1, 4, 8, 1)).items()}
        eager = static_backend(model, name, device, max_context=mc, graphs="eager")
        rec["kernels"][f"cache {mc}"] = kernel_table(eager, device, args.context)
        del static, eager
        print(json.dumps(rec["pass_ms"]), flush=True)
    if args.compile_sizes:
        sizes = tuple(int(n) for n in args.compile_sizes.split(","))
        for mc in contexts:
            t0 = time.perf_counter()
            fused = static_backend(model, name, device, max_context=mc, graphs=graphs,
                                   compile=True)
            times = [curve(fused, device, args.reps, args.context, sizes) for _ in range(3)]
            rec["pass_ms"][f"compiled, cache {mc}"] = {
                n: [round(t[n], 3) for t in times] for n in sizes}
            rec[f"compile_s cache {mc}"] = round(time.perf_counter() - t0, 1)
            del fused
            print(json.dumps(rec["pass_ms"]), flush=True)
    rec["linear_ms"] = linear_parts(shape, vocab, device, layers)
    rec["attention_ms"] = attention_parts(shape, device, (1280, 8768), layers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_parts.json").write_text(json.dumps(rec, indent=2))
    lines = [f"# Parts of a decode pass of {name} on {rec['machine']} (random-init, bf16)", "",
             f"`{rec['command']}`; {args.context} cached tokens", "", "## Pass ms", ""]
    lines += [f"- {k}: {v}" for k, v in rec["pass_ms"].items()]
    for k, rows in rec["kernels"].items():
        lines += ["", f"## Kernels of one eager pass (n=1), {k}: µs per pass, launches", ""]
        lines += [f"- {g}: {t} µs, {c}" for g, t, c in rows[:12]]
    lines += ["", "## Linear maps (ms per call, inside a graph)", ""]
    lines += [f"- {k}: {v}" for k, v in rec["linear_ms"].items()]
    lines += ["", "## Attention (ms per layer-call, one token)", ""]
    lines += [f"- {k}: {v}" for k, v in rec["attention_ms"].items()]
    (out / "decode_parts.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
