"""`adaspec head`: record the target's features and train a draft head on them (issue 65).

adaspec head data --out DATA          # the target's features over training prompts (resumable)
adaspec head train --data DATA --out head.pt
adaspec generate "..." --method head:artifact=head.pt

Only the prompts DESIGN.md lets train: ShareGPT's first 12,000 conversations (with their
answers), the WMT prompts, HumanEval 0-59 and Spec-Bench's odd question ids (these three
answered by the target itself, greedy).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, cast


def add_head_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("head", help="record the target's features and train a draft head",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_subparsers(dest="head_command", required=True)

    c = s.add_parser("data", help="the target's features over training prompts")
    c.add_argument("--target", default=None,
                   help="the target: a built-in model name (default: the built-in target)")
    c.add_argument("--out", required=True, help="folder; an interrupted run resumes")
    c.add_argument("--sharegpt", type=int, default=1200,
                   help="ShareGPT conversations (file index < 12,000), their own answers")
    c.add_argument("--wmt", type=int, default=200, help="WMT prompts, the target answers")
    c.add_argument("--humaneval", type=int, default=60, help="HumanEval problems (<= 60)")
    c.add_argument("--spec-bench", type=int, default=240,
                   help="Spec-Bench questions with odd ids, the target answers")
    c.add_argument("--max-tokens", type=int, default=384, help="tokens per example (cut)")
    c.add_argument("--answer-tokens", type=int, default=160,
                   help="longest answer the target writes")
    c.add_argument("--batch", type=int, default=16, help="prompts answered together")
    c.add_argument("--scorer", choices=["runtime", "torch"], default="runtime",
                   help="what scores the examples: the fastest runtime (its features are "
                   "what the head reads at inference) or torch")
    c.add_argument("--layers", action="store_true",
                   help="also record low/middle/high layers (EAGLE-3 heads; torch runtime only)")
    c.add_argument("--no-progress", action="store_true")
    c.set_defaults(func=run_data)

    t = s.add_parser("train", help="train a head on recorded features")
    t.add_argument("--data", required=True, help="a folder `adaspec head data` wrote")
    t.add_argument("--target", default=None,
                   help="the target the data is of (default: the built-in target)")
    t.add_argument("--out", required=True, help="the head's file (.pt, beside it a .json)")
    t.add_argument("--mlp", type=int, default=1024, help="the head layer's MLP width")
    t.add_argument("--heads", type=int, default=4, help="query heads (the target's: 12)")
    t.add_argument("--vocab", type=int, default=8192, help="kept tokens of the output head")
    t.add_argument("--features", choices=["final", "layers"], default="final",
                   help="the target's last feature (EAGLE) or low/mid/high layers (EAGLE-3)")
    t.add_argument("--depth", type=int, default=2, help="draft steps the loss unrolls")
    t.add_argument("--epochs", type=int, default=4)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--held", type=float, default=0.04,
                   help="share of the examples held out for validation")
    t.add_argument("--init", default="",
                   help="start from this head's weights (same shape; its kept tokens kept)")
    t.add_argument("--fp32", action="store_true", help="train in fp32 (default: bf16 autocast)")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=run_train)


def _machine() -> dict:
    import platform

    import torch

    return {"cpu": platform.processor() or platform.machine(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": str(torch.__version__),
            "threads": torch.get_num_threads()}


def run_data(args: argparse.Namespace) -> int:
    from adaspec.backends.load import load_backends
    from adaspec.errors import InputError
    from adaspec.lab.head import data as head_data

    out = Path(args.out)
    examples = head_data.training_examples(args.sharegpt, args.wmt, args.humaneval,
                                           args.spec_bench)
    print(f"{len(examples)} training examples", file=sys.stderr)
    t0 = time.perf_counter()
    model: Any = None  # the target in transformers (own answers, the torch scorer)
    if args.scorer == "torch" or args.layers or any(not e.answer for e in examples):
        torch_target, tokenizer, _, eos = load_backends(_target(args), draft=None,
                                                        weights="none")
        model = cast(Any, torch_target).model.eval()
        del torch_target  # `model` is what is read from here on
        examples = head_data.own_answers(model, tokenizer, examples, out / "answers.jsonl",
                                         args.answer_tokens, list(eos), args.batch,
                                         progress=not args.no_progress)
    answered = time.perf_counter() - t0
    scorer: head_data.TorchScorer | head_data.BackendScorer
    if args.scorer == "torch" or args.layers:
        scorer = head_data.TorchScorer(model, args.layers)
    else:
        model = None  # the torch copy is not needed past the answers: free it
        runtime, tokenizer, _, eos = load_backends(_target(args), draft=None)
        if not runtime.has_features:
            raise InputError(f"the {runtime.kind} runtime returns no target features: "
                             f"--scorer torch, or adaspec runtime build")
        scorer = head_data.BackendScorer(runtime)
    manifest = head_data.collect(scorer, tokenizer, examples, out / "features",
                                 args.max_tokens, eos=int(eos[0]),
                                 progress=not args.no_progress)
    print(json.dumps({"examples": len(examples), "tokens": manifest.get("tokens"),
                      "answer_seconds": round(answered, 1),
                      "feature_seconds": round(manifest.get("seconds", 0.0), 1)}))
    return 0


def _target(args: argparse.Namespace) -> str:
    from adaspec.store.catalog import TARGET_DEFAULT

    return args.target or TARGET_DEFAULT


def _data_sha256(folder: Path) -> str:
    return hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()


def run_train(args: argparse.Namespace) -> int:
    import torch

    from adaspec.draft import head_artifact
    from adaspec.errors import InputError
    from adaspec.lab.head import data as head_data
    from adaspec.lab.head import train as head_train
    from adaspec.store.atomic import write_json
    from adaspec.store.loading import cache_dir_for

    features = Path(args.data) / "features"
    if not (features / "manifest.json").is_file():
        raise InputError(f"{args.data} holds no recorded features: adaspec head data --out "
                         f"{args.data}")
    rows = head_data.load_rows(features)
    held, train = head_data.split_held(rows, args.held)
    target = _target(args)
    weights = cache_dir_for(target) / "model.safetensors"
    if not weights.is_file():
        raise InputError(f"{weights} is missing: the head reads the target's embeddings and "
                         f"output rows from its bf16 copy (adaspec models prepare)")
    config = head_artifact.target_config(weights.parent)
    vocab = int(config.vocab_size)
    eos = head_artifact.end_tokens(weights.parent)
    start = head_artifact.load(args.init) if args.init else None
    token_ids = start.token_ids if start is not None else \
        head_train.kept_tokens(train, args.vocab, vocab, eos)
    embed, tokens = head_artifact.target_parts(None, weights, token_ids, torch.float32)
    frozen = head_train.Frozen(embed.float(), tokens, head_train.kept_index(token_ids, vocab))
    if start is not None:
        head = start.head(torch.float32).train()
    else:
        head = head_train.new_head(config, args.mlp, 3 if args.features == "layers" else 1,
                                   heads=args.heads)
    cfg = head_train.TrainConfig(depth=args.depth, epochs=args.epochs, lr=args.lr,
                                 features=args.features, bf16=not args.fp32)
    checkpoint = Path(args.out).with_suffix(".ckpt")
    report = head_train.train(head, frozen, train, held, cfg, progress=not args.no_progress,
                              checkpoint=checkpoint)
    provenance = {
        "what": "draft head (EAGLE-style) for " + target,
        "commands": [*(start.provenance.get("commands", []) if start is not None else []),
                     " ".join(["adaspec", *sys.argv[1:]])],
        "data_manifest_sha256": _data_sha256(features),
        "trained_on": sorted({r["id"].rsplit("/", 1)[0] for r in train}),
        "examples": len(train), "held_out_examples": len(held),
        "held_out_agreement_by_depth": report.held_out,
        "train_seconds": round(report.seconds, 1),
        "date": time.strftime("%Y-%m-%d"), "machine": _machine(),
        "regenerate": "bash experiments/head_builtin.sh (the built-in target's head)",
    }
    head_artifact.save(Path(args.out), head, token_ids, provenance)
    write_json(Path(args.out).with_suffix(".json"), provenance)
    checkpoint.unlink(missing_ok=True)
    print(json.dumps({"out": args.out, "held_out_agreement_by_depth": report.held_out,
                      "seconds": round(report.seconds, 1)}))
    return 0
