"""What a pass costs on a GPU (issue 34), measured without weights: random-init models of the
real shapes (the built-in 1.5B target and 0.5B draft), bf16, on adaspec's static-cache
runtime and on transformers. Writes small summaries (gpu_costs.json / gpu_costs.md) to --out
(the device tool's $OUT):

- a pass of n = 1..64 tokens after a 512-token cache (the verification curve), per runtime:
  the static runtime with CUDA graphs (its GPU default), the same without graphs, and
  transformers;
- plain decoding ms/token of Hugging Face `generate` (static cache, greedy);
- one call carrying a token for each of 1, 2, 4, 8 requests (the static runtime's batched
  cache, continuous batching's slack on a GPU);
- one step of the draft head of the shipped shape (random init) over the target, eager and
  in a CUDA graph, against a target step; and the target's pass of 1-8 tokens returning its
  features (the head's input) beside the logits;
- the target's concurrency sweep: 1, 4, 16, 64 requests decoded together in process on the
  static runtime (adaspec's batch driver), aggregate tokens/s, against transformers' batched
  `generate` on the same prompts;
- adaspec's own plain loop on the static runtime: the target's ms per step beside the loop's
  own ms per step (verification, bookkeeping; `RequestStats.loop_time`);
- the physical floor: weight bytes a pass reads over the measured device copy bandwidth;
- the target's batch cost (gpu_batch_cost.json, what `adaspec profile --batch 64` measures:
  one call by sequences, up to 64, and tokens each, what a server prices drafts by);
- a cost profile of the pair (gpu_profile.json, what `adaspec profile --device cuda` measures),
  for `adaspec bench --replay RESULTS --profile gpu_profile.json`: the CPU runs' acceptance
  re-priced under the GPU's costs (predicted, not measured).

On the device machine (nothing to install: torch and transformers are there):

    PYTHONPATH=src python experiments/gpu_costs.py --out $OUT

`--device cpu --tiny` runs the same code on small shapes (a smoke test on any machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

# The built-in models' shapes (their config.json in the model store).
SHAPES = {
    "qwen2.5-coder-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                               num_attention_heads=12, num_key_value_heads=2),
    "qwen2.5-coder-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2),
}
TINY = {"tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2),
        "tinier": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2)}
SIZES = (1, 2, 4, 8, 16, 32, 64)


def add_common(ap, out: str) -> None:
    """The options every GPU experiment takes (this one and those that import it)."""
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes (a smoke test)")
    ap.add_argument("--out", default=out)


def shapes_for(tiny: bool) -> tuple[dict, int]:
    """The models' shapes and vocabulary: the built-in pair's, or tiny ones."""
    return (TINY, 1000) if tiny else (SHAPES, 151_936)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int) -> float:
    """Median ms of `fn()` over `reps` runs after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def model_of(shape: dict, vocab: int, device: str, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, max_position_embeddings=4096, rope_theta=1e6,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, **shape)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(dtype).eval()
    return model


def curve(backend, device: str, reps: int, context: int,
          sizes: tuple[int, ...] = SIZES) -> dict[int, float]:
    """ms of a pass of n tokens after `context` cached ones (rolled back after each)."""
    backend.reset()
    backend.prefill(torch.randint(0, 1000, (context,)))
    out = {}
    for n in sizes:
        tokens = torch.randint(0, 1000, (n,))

        def one(tokens=tokens) -> None:
            backend.forward(tokens)
            backend.truncate(context)

        out[n] = timed(one, device, reps)
    return out


def batch_curve(static, device: str, reps: int, context: int) -> dict[int, float]:
    """ms of one call carrying one token for each of B requests (the static runtime's
    batched cache, backends/torch/static_batch.py: fixed shapes, graphs on a GPU),
    B = 1, 2, 4, 8."""
    from adaspec.backends.sequences import ALL, LAST, forward_together

    views = static.sequences(8)
    prompt = torch.randint(0, 1000, (context,)).tolist()
    forward_together([(v, prompt, LAST) for v in views])
    out = {}
    for b in (1, 2, 4, 8):
        def one(b=b) -> None:
            forward_together([(v, [7], ALL) for v in views[:b]])
            for v in views[:b]:
                v.truncate(context)

        out[b] = timed(one, device, reps)
    return out


def loop_step_ms(backend, tokens: int) -> dict[str, float]:
    """adaspec's plain loop on `backend`: the target's ms per step and the loop's own."""
    from adaspec.engine.loop import Engine

    engine = Engine(backend, None, eos_token_ids=[])
    prompt = torch.randint(0, 1000, (64,)).tolist()
    engine.generate(prompt, 8, chat=False)  # warm-up (graph capture)
    stats = engine.generate(prompt, tokens + 1, chat=False).stats
    steps = max(1, stats.target_calls - 1)
    return {"target_ms_per_step": round(1000 * stats.target_time / steps, 3),
            "loop_ms_per_step": round(1000 * stats.loop_time / steps, 3),
            "ms_per_token": round(1000 * (stats.wall_time - stats.prefill_time) / steps, 3)}


FEATURE_SIZES = (1, 2, 4, 8)  # passes timed with the target's features recorded

# The shipped draft head's shape (src/adaspec/draft/builtin/head-*.json): one decoder layer
# with 4 query heads and an MLP of 1024 over the target's hidden size, 8,192 kept tokens.
HEAD = {"heads": 4, "intermediate": 1024, "kept": 8192}
HEAD_TINY = {"heads": 2, "intermediate": 64, "kept": 256}


def head_step_ms(shape: dict, device: str, dtype: torch.dtype, reps: int, tiny: bool,
                 context: int = 256) -> dict[str, float]:
    """ms of one step of a random-init draft head of the shipped shape over the target's
    hidden size (what `HeadDrafter` runs per drafted token: the head over a cache of
    `context` positions, the kept tokens' logits, their argmax), eager and in a CUDA graph
    where there is one."""
    from adaspec.draft.head_model import DraftHead, HeadConfig, TokenHead

    h = HEAD_TINY if tiny else HEAD
    hidden, heads = shape["hidden_size"], shape["num_attention_heads"]
    cfg = HeadConfig(hidden=hidden, heads=h["heads"], kv_heads=shape["num_key_value_heads"],
                     head_dim=hidden // heads, intermediate=h["intermediate"])
    with torch.device(device):
        head = DraftHead(cfg).to(dtype).eval()
        tokens = TokenHead(torch.randn(h["kept"], hidden, dtype=dtype),
                           torch.arange(h["kept"]), h["kept"]).eval()
        kv = (torch.zeros(1, cfg.kv_heads, context, cfg.head_dim, dtype=dtype),
              torch.zeros(1, cfg.kv_heads, context, cfg.head_dim, dtype=dtype))
        feature = torch.randn(1, 1, hidden, dtype=dtype)
        embed = torch.randn(1, 1, hidden, dtype=dtype)
        position = torch.full((1, 1), context, dtype=torch.long)

    @torch.inference_mode()
    def step() -> torch.Tensor:
        out, _ = head(feature, embed, position, kv)
        return tokens(out).argmax(-1)

    out = {"eager_ms": round(timed(step, device, reps), 4)}
    if device == "cuda":
        from adaspec.backends.torch.graphs import capture_graph

        graph, _ = capture_graph(step, torch.cuda.graph_pool_handle())
        out["graph_ms"] = round(timed(graph.replay, device, reps), 4)
    return out


def concurrency_sweep(model, name: str, device: str, counts: tuple[int, ...],
                      prompt_len: int, new_tokens: int) -> dict[int, dict[str, float]]:
    """Aggregate tokens/s of `counts` requests decoded together in process: adaspec's
    plain loop on the static runtime's batched cache (one engine per request, the batch
    driver of the server), against transformers' batched greedy `generate` (its default
    cache) on the same prompts; fixed lengths (no end-of-sequence token)."""
    from adaspec.backends.torch.static import static_backend
    from adaspec.engine.batch import BatchDecoder
    from adaspec.engine.loop import Engine

    def run(engines: list, prompts: torch.Tensor, n: int) -> None:
        decoder = BatchDecoder()
        for i, e in enumerate(engines):
            decoder.add(i, e.stream_steps(prompts[i].tolist(), n, chat=False))
        while len(decoder):
            decoder.round()

    out: dict[int, dict[str, float]] = {}
    for b in counts:
        prompts = torch.randint(0, 1000, (b, prompt_len))
        views = static_backend(model, name, device,
                               max_context=prompt_len + new_tokens + 32).sequences(b)
        engines = [Engine(v, None, eos_token_ids=[]) for v in views]
        run(engines, prompts, 4)  # warm-up: the shapes this count meets (graphs captured)
        sync(device)
        t0 = time.perf_counter()
        run(engines, prompts, new_tokens)
        sync(device)
        ours = b * new_tokens / (time.perf_counter() - t0)
        del engines, views
        # its default (dynamic) cache: a static one compiles per batch shape on a GPU,
        # minutes of a device call
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                      pad_token_id=0)
        ids = prompts.to(device)
        model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        sync(device)
        t0 = time.perf_counter()
        model.generate(ids, **kwargs)
        sync(device)
        theirs = b * new_tokens / (time.perf_counter() - t0)
        out[b] = {"adaspec_tok_s": round(ours, 1), "hf_generate_tok_s": round(theirs, 1)}
        print(f"{name}: {b} requests: adaspec {ours:.1f} tok/s, HF generate {theirs:.1f}",
              flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def hf_generate_ms(model, device: str, tokens: int) -> float:
    """ms per token of transformers' greedy `generate` with a static cache."""
    prompt = torch.randint(0, 1000, (1, 64), device=device)
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                  pad_token_id=0, cache_implementation="static")
    model.generate(prompt, **kwargs)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    model.generate(prompt, **kwargs)
    sync(device)
    return 1000 * (time.perf_counter() - t0) / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes (a smoke test)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--generate-tokens", type=int, default=128)
    ap.add_argument("--out", default="experiments/results/gpu-costs")
    ap.add_argument("--no-profile", action="store_true", help="skip the pair's cost profile")
    ap.add_argument("--compile-sizes", default="1,8",
                    help="pass sizes also timed compiled by torch.compile ('' to skip)")
    ap.add_argument("--compile-all", action="store_true",
                    help="compile the draft's passes too (default: the target's only)")
    ap.add_argument("--sweep", default="1,4,16,64",
                    help="requests decoded together in the target's concurrency sweep "
                         "('' to skip)")
    ap.add_argument("--sweep-tokens", type=int, default=64,
                    help="new tokens per request in the sweep (prompts of 128)")
    args = ap.parse_args()

    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.backends.torch.static import static_backend
    from adaspec.cost.measure import copy_bandwidth_gbs

    device, dtype = args.device, torch.bfloat16
    shapes, vocab = (TINY, 1000) if args.tiny else (SHAPES, 151_936)
    machine = (torch.cuda.get_device_name(0) if device == "cuda" else "cpu")
    bandwidth = copy_bandwidth_gbs(64 if args.tiny else 1024, 10, device)
    record: dict = {"machine": machine, "torch": torch.__version__, "dtype": "bfloat16",
                    "copy_gbs": round(bandwidth, 1), "context": args.context, "models": {},
                    "command": "PYTHONPATH=src python experiments/gpu_costs.py "
                               + ("--tiny --device cpu" if args.tiny else "--out $OUT"),
                    "note": "random-init weights of the real shapes: costs, not outputs"}
    models = {}
    for name, shape in shapes.items():
        model = models[name] = model_of(shape, vocab, device, dtype)
        static = static_backend(model, name, device, max_context=args.context + 256)
        floor = static.bytes_per_forward / (bandwidth * 1e9) * 1000
        row = {"weight_bytes": static.bytes_per_forward, "floor_ms": round(floor, 3),
               "graphs": static.graphs,
               "static_ms": {n: round(v, 3) for n, v in
                             curve(static, device, args.reps, args.context).items()}}
        if len(models) == 1:  # the target: what returning its features (a head's input)
            # adds to a pass (read back to the host beside the logits, as the engine takes them)
            static.record_features(True)
            row["static_features_ms"] = {n: round(v, 3) for n, v in curve(
                static, device, args.reps, args.context, FEATURE_SIZES).items()}
            static.record_features(False)
        row["loop"] = loop_step_ms(static, args.generate_tokens)
        row["batch_ms"] = {b: round(v, 3) for b, v in
                           batch_curve(static, device, args.reps, args.context).items()}
        del static
        if device == "cuda":  # what the graphs buy
            eager = static_backend(model, name, device, args.context + 256, graphs="off")
            row["static_no_graphs_ms"] = {n: round(v, 3) for n, v in
                                          curve(eager, device, args.reps, args.context).items()}
            del eager
        if args.compile_sizes and (len(models) == 1 or args.compile_all):  # compiling
            # takes 20-25 s per size on the H200: the target (first) only unless asked
            sizes = tuple(int(n) for n in args.compile_sizes.split(","))
            t0 = time.perf_counter()
            fused = static_backend(model, name, device, args.context + 256,
                                   graphs="cuda" if device == "cuda" else "eager", compile=True)
            row["static_compiled_ms"] = {
                n: round(v, 3) for n, v in curve(fused, device, args.reps, args.context,
                                                 sizes).items()}
            row["compiled"] = fused.compiled  # False: the compiler failed, eager was timed
            row["compile_s"] = round(time.perf_counter() - t0, 1)
            del fused
        hf = TorchBackend(model, name)
        row["transformers_ms"] = {n: round(v, 3) for n, v in
                                  curve(hf, device, args.reps, args.context).items()}
        del hf
        row["hf_generate_ms_per_token"] = round(
            hf_generate_ms(model, device, args.generate_tokens), 3)
        row["static_1_over_floor"] = round(row["static_ms"][1] / floor, 2)
        if len(models) == 1:  # the target: the draft head over it, and many requests
            row["head_step"] = head_step_ms(shape, device, dtype, args.reps, args.tiny)
            row["head_over_step"] = round(row["head_step"].get(
                "graph_ms", row["head_step"]["eager_ms"]) / row["static_ms"][1], 4)
            if args.sweep:
                row["sweep"] = concurrency_sweep(
                    model, name, device, tuple(int(b) for b in args.sweep.split(",")),
                    128, args.sweep_tokens)
        record["models"][name] = row
        print(name, json.dumps(row), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if len(models) == 2 and not args.no_profile:
        from adaspec.cost.cache import profile_key
        from adaspec.cost.measure import measure_profile
        from adaspec.engine.overhead import loop_overhead_ms

        target_name, draft_name = list(models)
        target = static_backend(models[target_name], target_name, device, 4096)
        draft = static_backend(models[draft_name], draft_name, device, 4096)
        key = {**profile_key(target, draft), "note": "random-init weights of the real shapes"}
        profile = measure_profile(target, draft, None, key=key, progress=False,
                                  loop_overhead=loop_overhead_ms)
        profile.save(out / "gpu_profile.json")
        record["profile"] = "gpu_profile.json"
        # the batch dimension: what a server decoding up to 64 requests together prices by
        from adaspec.cost.batch import FORMAT, measure_batch_cost

        t0 = time.perf_counter()
        views = static_backend(models[target_name], target_name, device,
                               1024).sequences(8 if args.tiny else 64)
        batch = measure_batch_cost(views, {**key, "batch": FORMAT}, repeats=3)
        batch.save(out / "gpu_batch_cost.json")
        record["batch_cost"] = {"file": "gpu_batch_cost.json",
                                "seconds": round(time.perf_counter() - t0, 1)}
        del views
    (out / "gpu_costs.json").write_text(json.dumps(record, indent=2))
    lines = [f"# Pass costs on {machine} (bf16, random-init weights of the real shapes)", "",
             f"Copy bandwidth {record['copy_gbs']} GB/s; cache {args.context} tokens; "
             f"`{record['command']}`", "",
             "| model | floor ms | static n=1 | n=8 | n=64 | no graphs n=1 | compiled n=1 | "
             "transformers n=1 | n=8 | HF generate ms/token | adaspec ar: target / loop ms "
             "per step |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, r in record["models"].items():
        s, t = r["static_ms"], r["transformers_ms"]
        eager = r.get("static_no_graphs_ms", {}).get(1, "-")
        fused = r.get("static_compiled_ms", {}).get(1, "-")
        loop = r["loop"]
        lines.append(f"| {name} | {r['floor_ms']} | {s[1]} | {s[8]} | {s[64]} | {eager} | "
                     f"{fused} | {t[1]} | {t[8]} | {r['hf_generate_ms_per_token']} | "
                     f"{loop['target_ms_per_step']} / {loop['loop_ms_per_step']} |")
    lines += ["", "One call, one token for each of B requests (batched cache, graphs on a "
              "GPU), ms:", "",
              "| model | B=1 | B=2 | B=4 | B=8 |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in record["models"].items():
        bm = r["batch_ms"]
        lines.append(f"| {name} | {bm[1]} | {bm[2]} | {bm[4]} | {bm[8]} |")
    for name, r in record["models"].items():
        if "head_step" in r:
            hs = r["head_step"]
            lines += ["", f"The draft head (shipped shape, random init) over {name}: "
                      f"{hs.get('graph_ms', '-')} ms a step in a graph, {hs['eager_ms']} "
                      f"eager; {r['head_over_step']} of a target step (n=1)."]
        if "static_features_ms" in r:
            fm, plain = r["static_features_ms"], r["static_ms"]
            lines += ["", f"{name}'s pass returning its features (the head's input) beside "
                      "the logits, ms (without them): " + ", ".join(
                          f"n={n} {fm[n]} ({plain[n]})" for n in fm if n in plain) + "."]
        if r.get("sweep"):
            lines += ["", f"{name}, requests decoded together (prompts of 128, "
                      f"{args.sweep_tokens} new tokens each), aggregate tokens/s:", "",
                      "| requests | adaspec (static, batched) "
                      "| HF generate (batched, default cache) |",
                      "| ---: | ---: | ---: |"]
            lines += [f"| {b} | {v['adaspec_tok_s']} | {v['hf_generate_tok_s']} |"
                      for b, v in r["sweep"].items()]
    (out / "gpu_costs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
