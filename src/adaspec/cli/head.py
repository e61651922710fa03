"""`adaspec head`: record the target's features and train a draft head on them (issue 65).

adaspec head data --out DATA          # the target's features over training prompts (resumable)
adaspec head train --data DATA --out head.pt
adaspec generate "..." --method head:artifact=head.pt
adaspec head disco --data DATA --head head.pt --out disco.pt   # head:ctrl=disco,disco=...

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
    c.add_argument("--sharegpt-own", type=int, default=0,
                   help="ShareGPT prompts the target answers itself (its greedy answer: the "
                   "text the head drafts at inference), from file index --sharegpt-own-from")
    c.add_argument("--sharegpt-own-from", type=int, default=0,
                   help="the first file index of --sharegpt-own (below 12,000)")
    c.add_argument("--wmt", type=int, default=200, help="WMT prompts, the target answers")
    c.add_argument("--humaneval", type=int, default=60, help="HumanEval problems (<= 60)")
    c.add_argument("--spec-bench", type=int, default=240,
                   help="Spec-Bench questions with odd ids, the target answers")
    c.add_argument("--prompts", default="", metavar="FILE",
                   help="your own prompts, the target answers: a JSON list of strings, or "
                   'JSON lines (strings or objects with "prompt" and optionally "id")')
    c.add_argument("--max-tokens", type=int, default=384, help="tokens per example (cut)")
    c.add_argument("--answer-tokens", type=int, default=160,
                   help="longest answer the target writes")
    c.add_argument("--answers-by", choices=["engine", "torch"], default="engine",
                   help="what writes the target's own answers: adaspec's engine on the "
                   "fastest runtime, one prompt at a time (greedy: plain decoding's text), or "
                   "torch's batched generate (--batch)")
    c.add_argument("--batch", type=int, default=16,
                   help="prompts answered together (--answers-by torch)")
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

    d = s.add_parser("disco", help="DISCO's classifier for a head (head:ctrl=disco)")
    d.add_argument("--data", required=True, help="the folder the head was trained on")
    d.add_argument("--target", default=None,
                   help="the target the data is of (default: the built-in target)")
    d.add_argument("--head", default="", help="the head (default: the one shipped)")
    d.add_argument("--out", required=True, help="the classifier's file (.pt, beside it a .json)")
    d.add_argument("--held", type=float, default=0.04,
                   help="the head's held-out share (its `head train --held`): only examples "
                   "it never trained on are read")
    d.add_argument("--depth", type=int, default=4, help="longest draft described and tuned")
    d.add_argument("--val", type=float, default=0.3,
                   help="share of those examples that validates and tunes the classifier")
    d.add_argument("--profile", default="machine", metavar="FILE|machine",
                   help="the target's prices: a cost profile file, or this machine's cached "
                   "profile of the target (measured on first use)")
    d.add_argument("--samples", default="",
                   help="keep the head's recorded drafts in this file and read them from it "
                   "next time (the same head, data and depth)")
    d.add_argument("--head-ms", type=float, default=0.0,
                   help="a head step's price (0: timed here, right after a target call)")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=run_disco)


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
    if not 0 <= args.sharegpt_own_from < head_data.TRAIN_SHAREGPT:
        raise InputError(f"--sharegpt-own-from {args.sharegpt_own_from}: ShareGPT may train "
                         f"below file index {head_data.TRAIN_SHAREGPT} only")
    examples = head_data.training_examples(args.sharegpt, args.wmt, args.humaneval,
                                           args.spec_bench, args.sharegpt_own,
                                           args.sharegpt_own_from)
    if args.prompts:
        examples += head_data.read_prompts(Path(args.prompts))
    print(f"{len(examples)} training examples", file=sys.stderr)
    t0 = time.perf_counter()
    # answers a resumed run kept: no model loaded to answer what is answered already
    examples, pending = head_data.with_saved_answers(examples, out / "answers.jsonl")
    if args.answers_by == "engine" and pending:
        from adaspec.draft.head_artifact import builtin_for
        from adaspec.methods.build import load_generator

        # greedy: plain decoding's text whatever drafts it; no draft model to load
        method = "auto:use=ngram+history" + ("+head" if builtin_for(_target(args)) else "")
        generator = load_generator(method, target=_target(args), draft=None)
        end = getattr(generator.tokenizer, "eos_token_id", None)  # a chat turn's end
        examples = head_data.engine_answers(
            generator, examples, out / "answers.jsonl", args.answer_tokens,
            int(end) if end is not None else min(generator.eos_token_ids),
            progress=not args.no_progress)
        del generator  # its runtime is not needed past the answers
    model: Any = None  # the target in transformers (own answers, the torch scorer)
    if args.scorer == "torch" or args.layers or any(not e.answer and not e.answer_ids
                                                    for e in examples):
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


def _head_samples(path: Path | None, provenance: dict, depth: int) -> Any:
    """The DISCO data `--samples` kept, where it is of this head, data, split and depth."""
    from adaspec.lab.disco.dataset import DiscoData

    if path is None or not path.is_file():
        return None
    data = DiscoData.load(path)
    same = all(data.provenance.get(k) == v for k, v in provenance.items() if k != "head")
    if not same or data.provenance.get("depth") != depth:
        print(f"{path} is of another head, data or depth: recording again", file=sys.stderr)
        return None
    return data


def run_disco(args: argparse.Namespace) -> int:
    """Record the head's drafts on its held-out examples (no model call), train DISCO's
    classifier on them and tune its tau and SL_max by simulated latency at this machine's
    prices; the artifact names the head it read (`head_artifact.fingerprint`)."""
    import torch

    from adaspec.backends.load import load_backends
    from adaspec.control.disco_features import FeatureSpec
    from adaspec.cost.profile import load_profile
    from adaspec.draft import head_artifact
    from adaspec.draft.head import HeadDrafter
    from adaspec.errors import InputError
    from adaspec.lab.disco.head_data import cold_step_ms, collect_head
    from adaspec.lab.disco.simulate import Costs
    from adaspec.lab.disco.train_classifier import train_artifact
    from adaspec.lab.disco.tune import tune_artifact
    from adaspec.lab.head import data as head_data
    from adaspec.lab.head import train as head_train
    from adaspec.store.atomic import write_json
    from adaspec.store.loading import cache_dir_for

    if not 1 <= args.depth <= 8 or not 0 < args.val < 1 or not 0 < args.held < 1:
        raise InputError("--depth must be 1-8, --val and --held in (0, 1)")
    target_name = _target(args)
    head_path = Path(args.head) if args.head else head_artifact.builtin_for(target_name)
    if head_path is None or not head_path.is_file():
        raise InputError(f"no head to read: pass --head (none ships for {target_name})")
    features = Path(args.data) / "features"
    if not (features / "manifest.json").is_file():
        raise InputError(f"{args.data} holds no recorded features: adaspec head data --out "
                         f"{args.data}")
    weights = cache_dir_for(target_name) / "model.safetensors"
    if not weights.is_file():
        raise InputError(f"{weights} is missing: the head reads the target's embeddings and "
                         f"output rows from its bf16 copy (adaspec models prepare)")
    art = head_artifact.load(head_path)
    vocab = int(head_artifact.target_config(weights.parent).vocab_size)
    embed, tokens = head_artifact.target_parts(None, weights, art.token_ids, torch.float32)
    frozen = head_train.Frozen(embed.float(), tokens, head_train.kept_index(art.token_ids,
                                                                            vocab))
    name = head_artifact.fingerprint(head_path)
    provenance = {"target": target_name, "draft": name, "head": str(head_path),
                  "data_manifest_sha256": _data_sha256(features), "held": args.held,
                  "val": args.val}
    data = _head_samples(Path(args.samples) if args.samples else None, provenance, args.depth)
    if data is None:
        rows = head_data.load_rows(features, keep=lambda r: head_data.is_held(r, args.held))
        data = collect_head(art.head(torch.float32), frozen, rows, args.depth,
                            features="layers" if art.config.features > 1 else "final",
                            val_fraction=args.val, progress=not args.no_progress,
                            provenance=provenance)
        del rows
        if args.samples:
            data.save(args.samples)
    print(f"{len(data.samples)} held-out examples, {data.provenance['tokens']} answer tokens",
          file=sys.stderr)
    disco = train_artifact(data, data.suites, FeatureSpec())

    target: Any = None  # loaded only to measure what is not given
    tokenizer: Any = None
    if args.profile == "machine" or args.head_ms <= 0:
        target, tokenizer, _, _ = load_backends(target_name, draft=None)
    if args.profile == "machine":
        from adaspec.cost.cache import profile_for
        from adaspec.engine.overhead import loop_overhead_ms

        profile = profile_for(target, None, tokenizer, loop_overhead=loop_overhead_ms)
    else:
        profile = load_profile(args.profile)
    head_ms = args.head_ms
    if head_ms <= 0:
        drafter = HeadDrafter.load(head_path, target)
        typical = data.samples[len(data.samples) // 2]
        head_ms = cold_step_ms(drafter, target, (typical.prompt_ids + typical.output)[-256:])
    costs = Costs(draft_ms=head_ms,
                  target_ms=[profile.target_ms(n) for n in range(1, args.depth + 2)],
                  overhead_ms=profile.overhead_ms, source=f"profile:{profile.source}",
                  simulated=profile.simulated)
    print(f"prices: head step {head_ms:.2f} ms, target "
          + " / ".join(f"{ms:.1f}" for ms in costs.target_ms) + f" ms for 1-{args.depth + 1}"
          " rows" + (" (simulated profile)" if profile.simulated else ""), file=sys.stderr)
    val = [s for s in data.samples if s.split == "val"]
    result = tune_artifact(disco, val, costs, args.depth, log=lambda m: print(m,
                                                                            file=sys.stderr))
    out = Path(args.out)
    disco.save(out)
    best = result["best"]
    summary = {
        "what": f"DISCO classifier for the draft head {head_path.name} ({name}) of "
                f"{target_name}",
        "commands": [" ".join(["adaspec", *sys.argv[1:]])],
        "data_manifest_sha256": _data_sha256(features),
        "examples": len(data.samples), "tokens": data.provenance["tokens"],
        "tau": disco.tau, "sl_max": disco.sl_max, "costs": costs.to_dict(),
        "simulated_ms_per_token": {"ar": result["ar_ms_per_token"],
                                   **{k: {**{f: best[k][f] for f in ("sl_max", "threshold")},
                                          "ms_per_token": best[k]["ms_per_token"]}
                                      for k in ("static", "disco", "confidence")}},
        "date": time.strftime("%Y-%m-%d"), "machine": _machine(),
    }
    write_json(out.with_suffix(".json"), summary)
    print(json.dumps(summary["simulated_ms_per_token"], indent=1))
    return 0
