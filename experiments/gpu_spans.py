"""A fixed pass's attention span on a GPU: the static runtime's passes over the cache's first
`span` slots (a power of two covering the pass) against every slot of the cache, as before
(`MIN_SPAN` set past the cache reproduces that in the same process). Random-init weights of
the real shapes, bf16, the cache sized as the bench sizes it (8192 positions). Writes
spans.json / spans.md to --out after each part (a run cut short keeps what it measured):

- passes of n = 1, 2, 4, 8, 16, 64 tokens after 512 and 2048 cached ones, CUDA graphs,
  both ways;
- compiled (torch.compile, the span a dynamic dimension): n = 1, 4, 8 three times each,
  the compile time, and how many graphs were compiled;
- adaspec's plain loop (target ms per step, loop ms per step);
- a cost profile of the pair (graphs, not compiled, as issue 34's first run measured it),
  `gpu_profile.json`, for `adaspec bench --replay` (predicted figures).

    PYTHONPATH=src python3 experiments/gpu_spans.py --out $OUT
    PYTHONPATH=src python experiments/gpu_spans.py --device cpu --tiny   # smoke
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from gpu_costs import add_common, curve, loop_step_ms, model_of, shapes_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common(ap, "experiments/results/gpu-spans")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()

    import adaspec.backends.torch.static as st
    from adaspec.backends.torch.static import static_backend

    device = args.device
    shapes, vocab = shapes_for(args.tiny)
    graphs = "cuda" if device == "cuda" else "eager"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rec: dict = {"machine": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                 "torch": torch.__version__, "max_context": args.max_context,
                 "command": "PYTHONPATH=src python3 experiments/gpu_spans.py --out $OUT",
                 "note": "random-init weights of the real shapes: costs, not outputs",
                 "pass_ms": {}}

    def save() -> None:
        (out / "spans.json").write_text(json.dumps(rec, indent=2))
        lines = [f"# Attention spans of the static runtime on {rec['machine']}", "",
                 f"`{rec['command']}`; cache of {args.max_context} positions; ms", ""]
        lines += [f"- {k}: {v}" for k, v in rec.items() if k not in ("pass_ms", "command")]
        lines += [f"- {k}: {v}" for k, v in rec["pass_ms"].items()]
        (out / "spans.md").write_text("\n".join(lines) + "\n")

    models = {}
    name = next(iter(shapes))
    for key, shape in shapes.items():
        models[key] = model_of(shape, vocab, device, torch.bfloat16)
        models[key].config.max_position_embeddings = 32768  # the real checkpoints'
    model = models[name]
    sizes = (1, 2, 4, 8, 16, 64)
    for context in (512, 2048):
        for label, min_span in (("every slot (before)", 10**9), ("span", 256)):
            st.MIN_SPAN = min_span
            static = static_backend(model, name, device, args.max_context, graphs=graphs)
            rec["pass_ms"][f"graphs, {context} cached, {label}"] = {
                n: round(t, 3) for n, t in curve(static, device, args.reps, context,
                                                sizes).items()}
            del static
            print(json.dumps(rec["pass_ms"]), flush=True)
            save()
    st.MIN_SPAN = 256
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    fused = static_backend(model, name, device, args.max_context, graphs=graphs, compile=True)
    for context in (512, 2048):
        times = [curve(fused, device, args.reps, context, (1, 4, 8)) for _ in range(3)]
        rec["pass_ms"][f"compiled, {context} cached, span"] = {
            n: [round(t[n], 3) for t in times] for n in (1, 4, 8)}
        rec["compiled"] = fused.compiled
        rec["compile_and_time_s"] = round(time.perf_counter() - t0, 1)
        rec["compiled_graphs"] = counters["stats"]["unique_graphs"] - before
        print(json.dumps(rec["pass_ms"]), flush=True)
        save()
    rec["loop_compiled_span"] = loop_step_ms(fused, 128)
    del fused
    save()
    if not args.no_profile and len(models) == 2:
        from adaspec.cost.cache import profile_key
        from adaspec.cost.measure import measure_profile
        from adaspec.engine.overhead import loop_overhead_ms

        draft_name = list(models)[1]
        target = static_backend(model, name, device, 4096, graphs=graphs)
        draft = static_backend(models[draft_name], draft_name, device, 4096, graphs=graphs)
        key = {**profile_key(target, draft), "note": "random-init weights of the real shapes"}
        profile = measure_profile(target, draft, None, key=key, progress=False,
                                  loop_overhead=loop_overhead_ms)
        profile.save(out / "gpu_profile.json")
        rec["profile"] = "gpu_profile.json"
        save()
    print((out / "spans.md").read_text())


if __name__ == "__main__":
    main()
