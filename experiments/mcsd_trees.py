"""MCSD on the built-in pair: token trees vs chains, MCSS with / without replacement vs MCNS,
and what a tree costs per node.

Two parts, one process, the models loaded once (bf16):

- micro: target forward time for a flattened tree of n nodes (tree mask + positions) on a
  ~200-token cache, against a plain causal chain of the same length; and one draft level
  expanded either as one sequence under a tree mask (what the tree drafter does) or as a
  batch of one-token rows over a replicated cache.
- bench: `adaspec bench`'s runner (same prompts, methods alternating prompt by prompt after a
  warm-up, speedups over `ar` in the same run) on a few HumanEval and Spec-Bench prompts, at
  T=0 and at T=1.

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/mcsd_trees.py --part all

Writes experiments/results/mcsd/{micro.json, t0/, t1/}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from adaspec.core.token_tree import TokenTree, parse_branching

OUT = Path("experiments/results/mcsd")
SHAPES = ["1", "1x1x1x1", "2x2x2x1", "16x1", "8x2x1", "4x2x2x1"]
T0_METHODS = [
    "ar",
    "draft:k=2",
    "draft:k=3",
    "draft:k=4",
    "draft:tree=16x1",
    "draft:tree=8x2x1",
    "draft:tree=2x2x2x1",
    "draft:tree=4x2x2x1",
]
T1_METHODS = [
    "ar",
    "draft:k=2",
    "draft:k=3",
    "draft:k=4",
    "draft:tree=16x1,verify=mcss-wor",
    "draft:tree=8x2x1,verify=mcss-wor",
    "draft:tree=2x2x2x1,verify=mcss-wor",
    "draft:tree=4x2x2x1,verify=mcss-wor",
    "draft:tree=4x2x2x1,verify=mcss",
    "draft:tree=4x2x2x1,verify=mcns",
]


def median_ms(fn, reps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def regular_tree(shape: str, root: int, vocab: int, gen: torch.Generator) -> TokenTree:
    tree = TokenTree.root(root)
    frontier = [0]
    for b in parse_branching(shape):
        parents = [p for p in frontier for _ in range(b)]
        frontier = tree.add_level(
            parents, torch.randint(vocab, (len(parents),), generator=gen).tolist()
        )
    return tree


def micro(target, draft, prefix: list[int], reps: int, draft_only: bool = False) -> dict:
    gen = torch.Generator().manual_seed(0)
    out: dict = {"cache_tokens": len(prefix) - 1, "target": [], "draft_level": []}
    if not draft_only:
        target_costs(target, prefix, reps, gen, out)
    draft_level_costs(draft, prefix, reps, gen, out)
    return out


def target_costs(target, prefix: list[int], reps: int, gen: torch.Generator, out: dict) -> None:
    target.prefill(torch.tensor(prefix[:-1]))
    base = target.cache_len
    for shape in SHAPES:
        tree = regular_tree(shape, prefix[-1], target.vocab_size, gen)
        tokens, positions, mask = tree.flatten(base)

        def tree_pass(tokens=tokens, positions=positions, mask=mask):
            target.forward(tokens, positions, mask)
            target.truncate(base)

        def chain_pass(tokens=tokens):
            target.forward(tokens)
            target.truncate(base)

        row = {
            "shape": shape,
            "nodes": len(tree),
            "tree_ms": median_ms(tree_pass, reps),
            "causal_ms": median_ms(chain_pass, reps),
        }
        out["target"].append(row)
        print(json.dumps(row), flush=True)
    head = target.model.get_output_embeddings()
    hidden = torch.randn(45, target.hidden_size, dtype=target.dtype)
    with torch.inference_mode():
        out["target_lm_head_ms"] = {
            n: median_ms(lambda n=n: head(hidden[:n]), reps) for n in (1, 16, 22, 32, 45)
        }
    print(json.dumps(out["target_lm_head_ms"]), flush=True)
    one = out["target"][0]["tree_ms"]
    for row in out["target"][1:]:
        row["extra_ms_per_node"] = (row["tree_ms"] - one) / (row["nodes"] - 1)


def draft_level_costs(draft, prefix: list[int], reps: int, gen: torch.Generator, out: dict) -> None:
    """One draft level of f siblings: a tree-masked sequence vs a batch over a copied cache."""
    draft.prefill(torch.tensor(prefix))
    dbase = draft.cache_len
    model = draft.model
    layers = list(draft._cache.layers)
    for f in (4, 8, 16):
        toks = torch.randint(draft.vocab_size, (f,), generator=gen)
        mask = torch.cat(
            [torch.ones(f, dbase, dtype=torch.bool), torch.eye(f, dtype=torch.bool)], dim=1
        )

        def masked(toks=toks, mask=mask, f=f):
            draft.forward(toks, torch.full((f,), dbase), tree_mask=mask)
            draft.truncate(dbase)

        def copied_cache(f=f):
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
            for i, layer in enumerate(layers):  # the single-row cache, f times
                cache.update(
                    layer.keys.expand(f, -1, -1, -1).contiguous(),
                    layer.values.expand(f, -1, -1, -1).contiguous(),
                    i,
                )
            return cache

        def batched(toks=toks, f=f, cache=None):
            with torch.inference_mode():
                cache = cache if cache is not None else copied_cache()
                model(
                    input_ids=toks.view(f, 1),
                    position_ids=torch.full((f, 1), dbase),
                    past_key_values=cache,
                    use_cache=True,
                )
                cache.crop(-f)  # drop the f new tokens again

        def causal(toks=toks):
            draft.forward(toks)
            draft.truncate(dbase)

        row = {
            "frontier": f,
            "tree_mask_ms": median_ms(masked, reps),
            "causal_same_tokens_ms": median_ms(causal, reps),
        }
        try:
            row["batched_with_cache_copy_ms"] = median_ms(batched, reps)
            with torch.inference_mode():
                kept = copied_cache()
            row["batched_forward_only_ms"] = median_ms(lambda b=batched, c=kept: b(cache=c), reps)
        except Exception as exc:  # report, do not lose the rest of the run
            row["batched_error"] = f"{type(exc).__name__}: {exc}"[:300]
        out["draft_level"].append(row)
        print(json.dumps(row), flush=True)


def bench(target, tokenizer, draft, eos, temperature: float, methods, prompts, tokens, out):
    from adaspec.lab.bench.runner import BenchConfig, BenchRunner

    config = BenchConfig(
        methods=methods,
        max_new_tokens=tokens,
        temperature=temperature,
        seed=0,
        out=str(out),
        overwrite=True,
        target=target.name,
        draft=draft.name,
        dtype="bfloat16",
    )
    runner = BenchRunner(config, target, tokenizer, draft, eos, progress=False)
    return runner.run(prompts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--part", choices=["micro", "draft-micro", "bench", "t0", "t1", "all"], default="all"
    )
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--humaneval", type=int, default=2)
    ap.add_argument("--spec", default="summarization,qa", help="Spec-Bench categories, 1 each")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)

    from adaspec.backends.base import eos_ids_of
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.lab.bench.suites import humaneval, spec_bench
    from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT
    from adaspec.store.model_store import load_model

    torch.set_num_threads(2)
    tgt = load_model(TARGET_DEFAULT, dtype="bfloat16")
    drf = load_model(DRAFT_DEFAULT, dtype="bfloat16")
    target = TorchBackend(tgt.model, name=tgt.name)
    draft = TorchBackend(drf.model, name=drf.name)
    eos = eos_ids_of(tgt.model, tgt.tokenizer)
    OUT.mkdir(parents=True, exist_ok=True)

    prompts = humaneval(args.humaneval)
    wanted = [c for c in args.spec.split(",") if c]
    prompts += [p for p in spec_bench(1) if p.category in wanted]

    if args.part in ("micro", "draft-micro", "all"):
        text = prompts[0].text
        ids = tgt.tokenizer.encode(text * 4, add_special_tokens=False)[:201]
        result = micro(target, draft, ids, args.reps, draft_only=args.part == "draft-micro")
        path = OUT / "micro.json"
        if args.part == "draft-micro" and path.exists():  # keep the target rows of a full run
            result = {**json.loads(path.read_text()), "draft_level": result["draft_level"]}
        path.write_text(json.dumps(result, indent=2) + "\n")
    if args.part in ("bench", "t0", "all"):
        bench(target, tgt.tokenizer, draft, eos, 0.0, T0_METHODS, prompts, args.tokens, OUT / "t0")
    if args.part in ("bench", "t1", "all"):
        bench(target, tgt.tokenizer, draft, eos, 1.0, T1_METHODS, prompts, args.tokens, OUT / "t1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
