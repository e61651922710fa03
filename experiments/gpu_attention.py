"""Attention of a fixed pass of n > 1 tokens on a GPU: the static runtime calls SDPA with a
boolean mask and grouped query heads (`enable_gqa`), which a masked call runs on the math
path. Against that: a group's query heads folded into rows (no grouped heads, so the
memory-efficient kernel takes the mask). One layer's attention alone (inside a CUDA graph),
then whole passes of the 1.5B (random-init, bf16, graphs) with the folded call swapped in.
Writes attention.json / attention.md to --out.

    PYTHONPATH=src python3 experiments/gpu_attention.py --out $OUT
    PYTHONPATH=src python experiments/gpu_attention.py --device cpu --tiny   # smoke
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_costs import add_common, curve, model_of, shapes_for
from gpu_decode_parts import graph_ms


def folded(q, keys, values, mask):
    """SDPA with a group's query heads as rows: q [b, heads, n, d], keys / values
    [b, kv_heads, span, d], mask [n, span] or [b, 1, n, span] -> [b, heads, n, d]."""
    b, heads, n, d = q.shape
    g = heads // keys.shape[1]
    qf = q.reshape(b, keys.shape[1], g * n, d)
    mf = mask.repeat(g, 1) if mask.dim() == 2 else mask.repeat(1, 1, g, 1)
    return F.scaled_dot_product_attention(qf, keys, values, attn_mask=mf).view(b, heads, n, d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common(ap, "experiments/results/gpu-attention")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()

    import adaspec.backends.torch.decoder as dec
    from adaspec.backends.torch.static import static_backend

    device = args.device
    shapes, vocab = shapes_for(args.tiny)
    name = next(iter(shapes))
    shape = shapes[name]
    heads, kvh = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape["hidden_size"] // heads
    layers = shape["num_hidden_layers"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rec: dict = {"machine": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                 "command": "PYTHONPATH=src python3 experiments/gpu_attention.py --out $OUT",
                 "layer_ms": {}, "pass_ms": {}}
    bf = torch.bfloat16
    for span in (1024, 4096):
        for n in (1, 4, 16):
            q = torch.randn(1, heads, n, d, device=device, dtype=bf)
            k = torch.randn(1, kvh, span, d, device=device, dtype=bf)
            v = torch.randn_like(k)
            mask = torch.zeros(n, span, dtype=torch.bool, device=device)
            mask[:, : span // 2] = True
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            err = (folded(q, k, v, mask) - ref).abs().max().item()
            rec["layer_ms"][f"span {span} n {n}"] = {
                "gqa mask": round(graph_ms(lambda q=q, k=k, v=v, mask=mask:
                                           F.scaled_dot_product_attention(
                                               q, k, v, attn_mask=mask, enable_gqa=True),
                                           device, layers), 4),
                "folded mask": round(graph_ms(lambda q=q, k=k, v=v, mask=mask:
                                              folded(q, k, v, mask), device, layers), 4),
                "max abs diff": err}
    print(json.dumps(rec["layer_ms"], indent=1), flush=True)
    model = model_of(shape, vocab, device, bf)
    model.config.max_position_embeddings = 32768
    graphs = "cuda" if device == "cuda" else "eager"
    real = F.scaled_dot_product_attention

    def swapped(q, k, v, attn_mask=None, enable_gqa=False, **kw):
        if enable_gqa and attn_mask is not None and q.shape[1] != k.shape[1]:
            return folded(q, k, v, attn_mask)
        return real(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa, **kw)

    for label, fn in (("gqa mask (now)", real), ("folded", swapped)):
        dec.F.scaled_dot_product_attention = fn
        static = static_backend(model, name, device, 8192, graphs=graphs)
        for context in (512, 2048):
            rec["pass_ms"][f"{label}, {context} cached"] = {
                n: round(t, 3) for n, t in curve(static, device, args.reps, context,
                                                (1, 4, 16)).items()}
        del static
        print(json.dumps(rec["pass_ms"]), flush=True)
    dec.F.scaled_dot_product_attention = real
    (out / "attention.json").write_text(json.dumps(rec, indent=2))
    lines = [f"# Masked attention of a fixed pass on {rec['machine']}", "",
             f"`{rec['command']}`", "", "One layer (ms):", ""]
    lines += [f"- {k}: {v}" for k, v in rec["layer_ms"].items()]
    lines += ["", "Whole passes of the 1.5B, graphs (ms):", ""]
    lines += [f"- {k}: {v}" for k, v in rec["pass_ms"].items()]
    (out / "attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
