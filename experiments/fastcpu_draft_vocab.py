"""Restricted draft head on the built-in pair: draft cost and acceptance / speedup by N.

One process, the models loaded once (bf16, torch threads = cores):

- corpus: greedy outputs of the target's GGUF through llama.cpp (`llamacpp`, the same model,
  Q4_K_M weights) on prompts outside the evaluation set (HumanEval 20-49, Spec-Bench questions
  2-5 of each category), written as bench rows so `adaspec models restrict-vocab` counts them
  beside the `ar` rows of earlier bench runs.
- sets: `adaspec models restrict-vocab` for each N, the evaluation prompts excluded.
- micro: draft forward time for one token on a 200-token cache, full head vs each N, and the
  output-head matmul alone.
- bench: the `adaspec bench` runner (same prompts, methods alternating prompt by prompt after a
  warm-up) with ar, llamacpp, draft:k=4 and draft:k=4,vocab=N on the quick profile's prompts
  (Spec-Bench 1 per category + HumanEval 0-1), greedy; plus draft:k=4 with the draft's GGUF
  run by llama.cpp (LlamaCppBackend) beside the bf16 torch target.

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/fastcpu_draft_vocab.py --part all

Writes experiments/results/fastcpu/{corpus/, draft_vocab_micro.json, draft_vocab/,
draft_vocab.md, draft_vocab.json}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.benchmark import Timer

OUT = Path("experiments/results/fastcpu")
SIZES = [4096, 8192, 16384, 32768]
CACHE_TOKENS = 200
LLAMA_DRAFT = "draft:k=4@llamacpp-draft"  # the same method, the draft's GGUF run by llama.cpp


def eval_prompts():
    """The quick profile's prompts: what the sets must not be counted on."""
    from adaspec.lab.bench.suites import humaneval, spec_bench

    return spec_bench(1) + humaneval(2)


def corpus_prompts(eval_ids: set[str]):
    from adaspec.lab.bench.suites import humaneval, spec_bench

    code = [p for p in humaneval(50)[20:] if p.id not in eval_ids]
    chat = [p for p in spec_bench(5) if p.id not in eval_ids]
    return code + chat


def corpus(engine, eos: list[int], gguf: Path, tokens: int, out: Path) -> None:
    """llama.cpp greedy outputs as bench rows (method llamacpp) + a run.json naming the target."""
    from adaspec.lab.bench.llamacpp_reference import open_decoder

    decoder = open_decoder(gguf, 0.0)
    prompts = corpus_prompts({p.id for p in eval_prompts()})
    out.mkdir(parents=True, exist_ok=True)
    settings = {"target": engine.target.name, "temperature": 0.0, "max_new_tokens": tokens}
    (out / "run.json").write_text(json.dumps({"settings": settings}, indent=2) + "\n")
    t0 = time.perf_counter()
    with (out / "results.jsonl").open("w") as f:
        for p in prompts:
            ids, stats = decoder.generate(engine.encode_prompt(p.text), tokens, eos)
            row = {"prompt_id": p.id, "category": p.category, "method": "llamacpp"}
            f.write(json.dumps({**row, "token_ids": ids, "wall_time": stats.wall_time}) + "\n")
    print(f"corpus: {len(prompts)} prompts in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def make_sets(draft_name: str, sizes: list[int]) -> None:
    from adaspec.cli import main

    exclude = ",".join(p.id for p in eval_prompts())
    # the corpus and the `ar` rows of the other runs under experiments/results (given
    # explicitly: restrict-vocab's default is the user's bench-results/)
    results = [str(p) for p in sorted(Path("experiments/results").glob("**/results.jsonl"))]
    argv = ["models", "restrict-vocab", "--draft", draft_name, "--exclude-prompts", exclude]
    argv += ["--results", *results]
    if main([*argv, "--top", ",".join(str(n) for n in sizes)]) != 0:
        raise SystemExit("restrict-vocab failed")


def median_ms(fn) -> float:
    return 1000 * Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=2).median


def llamacpp_draft(name: str):
    """The draft's GGUF as a llama.cpp backend, or None (with a note) without the extra."""
    from adaspec.backends.gguf import LlamaCppUnavailable, gguf_file
    from adaspec.backends.llamacpp.backend import LlamaCppBackend

    try:
        gguf = gguf_file(name)
        return LlamaCppBackend(gguf, torch.get_num_threads(), name=f"{name}@llamacpp")
    except LlamaCppUnavailable as exc:
        print(f"llama.cpp draft skipped: {exc}", file=sys.stderr)
        return None


def micro(draft, prefix: list[int], sizes: list[int], llama=None) -> dict:
    """Draft forward for one token after a CACHE_TOKENS cache, and the head matmul alone."""
    from adaspec.backends.torch.restricted_head import with_stored_vocab

    hidden = torch.randn(1, 1, draft.hidden_size, dtype=draft.dtype)
    rows = []
    for n in [0, *sizes]:
        backend = with_stored_vocab(draft, n)
        backend.prefill(torch.tensor(prefix))
        tok = torch.tensor([prefix[-1]])

        def step(backend=backend, tok=tok):
            backend.forward(tok)
            backend.truncate(len(prefix))

        head = backend.model.get_output_embeddings()
        rows.append(
            {
                "vocab": n or backend.vocab_size,
                "full": n == 0,
                "forward_ms": median_ms(step),
                "head_ms": median_ms(lambda head=head: head(hidden)),
                "bytes_per_forward": backend.bytes_per_forward,
            }
        )
        print(f"micro: {rows[-1]}", file=sys.stderr)
    if llama is not None:
        llama.prefill(torch.tensor(prefix))
        tok = torch.tensor([prefix[-1]])

        def llama_step():
            llama.forward(tok)
            llama.truncate(len(prefix))

        rows.append(
            {
                "vocab": llama.vocab_size,
                "full": True,
                "backend": "llama.cpp Q4_K_M",
                "forward_ms": median_ms(llama_step),
                "head_ms": None,
                "bytes_per_forward": llama.bytes_per_forward,
            }
        )
        print(f"micro: {rows[-1]}", file=sys.stderr)
    return {"cache_tokens": len(prefix), "threads": torch.get_num_threads(), "rows": rows}


def bench(
    target, tokenizer, draft, eos, gguf, sizes: list[int], tokens: int, out: Path, llama=None,
    prompt_ids: tuple[str, ...] = (),
) -> dict:
    from adaspec.lab.bench.runner import BenchConfig, BenchRunner
    from adaspec.methods.build import build_generator

    methods = ["ar", "llamacpp", "draft:k=4", *[f"draft:k=4,vocab={n}" for n in sizes]]
    engines = {}
    if llama is not None:
        engines[LLAMA_DRAFT] = build_generator("draft:k=4", target, tokenizer, llama, eos)
        methods.append(LLAMA_DRAFT)
    config = BenchConfig(
        methods=methods,
        suites=["spec-bench:1", "humaneval:2"],
        max_new_tokens=tokens,
        out=str(out),
        overwrite=True,
        target=target.name,
        draft=draft.name,
        dtype="bfloat16",
    )
    runner = BenchRunner(
        config, target, tokenizer, draft, eos, engines=engines, progress=False, target_gguf=gguf
    )
    prompts = [p for p in eval_prompts() if not prompt_ids or p.id in prompt_ids]
    return runner.run(prompts)


def report(micro_result: dict | None, summary: dict | None, sets: dict) -> str:
    lines = ["# Restricted draft head (draft:vocab=N)", ""]
    if sets:
        info = next(iter(sets.values()))
        lines += [
            f"Token sets counted on {info['tokens']} target tokens ({info['distinct']} distinct) "
            f"in {info['outputs']} greedy outputs: `ar` rows of earlier bench runs and "
            "`llamacpp` (Q4_K_M target) outputs on HumanEval 20-49 and Spec-Bench questions 2-5 "
            "per category; the evaluation prompts below were excluded. Special tokens always "
            "in; slots the counts leave open go to the lowest unseen ids.",
            "",
            "| N | ids seen in the counts | filled by lowest id |",
            "| ---: | ---: | ---: |",
        ]
        for n, s in sets.items():
            lines.append(f"| {n} | {s['from_counts']} | {s['filled_by_lowest_id']} |")
        lines.append("")
    if micro_result:
        rows = micro_result["rows"]
        full = rows[0]
        lines += [
            f"## Draft cost (0.5B, bf16, {micro_result['threads']} threads, one token after "
            f"a {micro_result['cache_tokens']}-token cache; medians)",
            "",
            "| head rows | draft forward | vs full | head matmul alone | weight bytes read |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in rows:
            head = "n/a" if r["head_ms"] is None else f"{r['head_ms']:.2f} ms"
            label = f"{r['vocab']}" + (f" ({r['backend']})" if r.get("backend") else "")
            lines.append(
                f"| {label} | {r['forward_ms']:.1f} ms | "
                f"{r['forward_ms'] / full['forward_ms']:.2f}x | {head} | "
                f"{r['bytes_per_forward'] / 1e6:.0f} MB |"
            )
        lines.append("")
    if summary:
        theory = summary.get("theory", {})
        lines += [
            "## End to end (greedy, "
            f"{summary['config']['max_new_tokens']} new tokens, {summary['config']['prompts']} "
            f"prompts: {', '.join(summary['config']['categories'])})",
            "",
            "| method | ms/token | speedup vs ar | MAT | acceptance | draft call | c |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for m, e in summary["methods"].items():
            t = theory.get(m, {})
            acc = f"{e['acceptance_rate']:.1%}" if e.get("drafted") else "n/a"
            call = f"{t['draft_call_ms']:.1f} ms" if t.get("draft_call_ms") else "n/a"
            c = f"{t['c']:.2f}" if t.get("c") else "n/a"
            lines.append(
                f"| `{m}` | {e['ms_per_token']:.0f} | {e['speedup']:.2f}x | "
                f"{e['mean_accepted_tokens']:.2f} | {acc} | {call} | {c} |"
            )
        ex = summary["exactness"]
        lines += [
            "",
            f"Exactness: {ex['differs']} of {ex['checked']} greedy outputs differ from `ar` "
            f"({ex['numerical_ties']} numerical ties, {ex['bugs']} bugs).",
        ]
        for m, o in ex.get("other_weights", {}).items():
            lines.append(
                f"`{m}` (Q4_K_M weights, not checked): {o['differ']} of {o['compared']} outputs "
                "differ from the bf16 target's."
            )
        lines += ["", "Full bench summary: [draft_vocab/summary.md](draft_vocab/summary.md)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["corpus", "sets", "micro", "bench", "all"], default="all")
    ap.add_argument("--sizes", default=",".join(str(n) for n in SIZES))
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per bench prompt")
    ap.add_argument("--corpus-tokens", type=int, default=80)
    ap.add_argument(
        "--no-llamacpp", action="store_true", help="do not load llama.cpp in this process"
    )
    ap.add_argument("--micro-out", default="draft_vocab_micro.json", help="file under OUT")
    ap.add_argument(
        "--prompt-ids",
        default="",
        help="bench only these evaluation prompts (comma-separated ids; default all eight)",
    )
    args = ap.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",")]

    from adaspec.backends.base import eos_ids_of
    from adaspec.backends.gguf import gguf_file
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.methods.build import build_generator
    from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT
    from adaspec.store.model_store import load_model
    from adaspec.store.token_set import load_token_set

    OUT.mkdir(parents=True, exist_ok=True)
    tgt = load_model(TARGET_DEFAULT, dtype="bfloat16")
    drf = load_model(DRAFT_DEFAULT, dtype="bfloat16")
    target = TorchBackend(tgt.model, name=tgt.name)
    draft = TorchBackend(drf.model, name=drf.name)
    eos = eos_ids_of(tgt.model, tgt.tokenizer)
    gguf = gguf_file(TARGET_DEFAULT)
    engine = build_generator("ar", target, tgt.tokenizer, None, eos)
    llama = None if args.no_llamacpp else llamacpp_draft(DRAFT_DEFAULT)

    if args.part in ("corpus", "all"):
        corpus(engine, eos, gguf, args.corpus_tokens, OUT / "corpus")
    if args.part in ("sets", "all"):
        make_sets(draft.name, sizes)
    sets = {n: load_token_set(draft.name, n).provenance for n in sizes}
    micro_path = OUT / args.micro_out
    if args.part in ("micro", "all"):
        prefix = engine.encode_prompt(eval_prompts()[0].text * 4)[:CACHE_TOKENS]
        micro_path.write_text(json.dumps(micro(draft, prefix, sizes, llama), indent=2) + "\n")
    if args.part in ("bench", "all"):
        out = OUT / "draft_vocab"
        ids = tuple(i for i in args.prompt_ids.split(",") if i)
        bench(target, tgt.tokenizer, draft, eos, gguf, sizes, args.tokens, out, llama, ids)
    micro_result = json.loads(micro_path.read_text()) if micro_path.exists() else None
    summary_path = OUT / "draft_vocab" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    (OUT / "draft_vocab.md").write_text(report(micro_result, summary, sets))
    combined = {"sets": sets, "micro": micro_result, "bench": summary and summary["methods"]}
    (OUT / "draft_vocab.json").write_text(json.dumps(combined, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
