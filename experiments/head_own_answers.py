"""Own answers or the dataset's (issue 65): fine-tune the shipped head on the same ShareGPT
prompts answered two ways, the target's own greedy answers (what the head drafts at
inference; EAGLE-3 and HASS train on them) and ShareGPT's teacher-forced answers, and compare
both with the shipped head on held-out prompts of each kind (split by prompt, so no prompt
trains one head and tests another), and on another recording's held-out examples.

    .venv/bin/python experiments/head_own_answers.py --answers DIR/answers.jsonl \
        --work DIR --compare /work/headdata/rt1 --out experiments/results/head-own-answers-<machine>

`answers.jsonl` holds the target's answers (`{"id": "sharegpt-own/I", "answer_ids": [...]}`,
as `adaspec head data --sharegpt-own` writes them). Prompts of file index below 12,000 only
(DESIGN.md); the shipped head trained on the first 4,500 (to file index 7,276).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def main() -> int:
    import torch

    from adaspec.backends.load import load_backends
    from adaspec.draft import head_artifact
    from adaspec.draft.builtin import __file__ as builtin_init
    from adaspec.lab.head import data as head_data
    from adaspec.lab.head import train as head_train
    from adaspec.store.catalog import TARGET_DEFAULT
    from adaspec.store.loading import cache_dir_for

    p = argparse.ArgumentParser()
    p.add_argument("--answers", required=True)
    p.add_argument("--work", required=True, help="where the two recordings go (resumable)")
    p.add_argument("--compare", default="", help="another recording: its held-out examples")
    p.add_argument("--held", type=float, default=0.15, help="share of prompts held out")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--max-tokens", type=int, default=320)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    own_ids = {}
    for line in Path(args.answers).read_text().splitlines():
        row = json.loads(line)
        own_ids[int(row["id"].rsplit("/", 1)[1])] = tuple(row["answer_ids"])
    pairs = {int(e.id.rsplit("/", 1)[1]): e for e in
             head_data.sharegpt_pairs(min(own_ids), max(own_ids) + 1) }
    own = [head_data.Example(f"sharegpt-own/{i}", pairs[i].prompt, answer_ids=a)
           for i, a in own_ids.items()]
    forced = [pairs[i] for i in own_ids]  # the same prompts, ShareGPT's answers

    work = Path(args.work)
    t0 = time.perf_counter()
    if not all((work / k / "manifest.json").is_file() and
               len(head_data.load_rows(work / k)) == len(own) for k in ("own", "forced")):
        target, tokenizer, _, eos = load_backends(TARGET_DEFAULT, draft=None, weights="none")
        model = target.model.eval()  # type: ignore[attr-defined]
        for name, examples in (("own", own), ("forced", forced)):
            head_data.collect(head_data.TorchScorer(model, False), tokenizer, examples,
                              work / name, args.max_tokens, eos=int(eos[0]))
        del model, target
    recorded = time.perf_counter() - t0

    def index(row: dict) -> int:
        return int(str(row["id"]).rsplit("/", 1)[1])

    def held(row: dict) -> bool:  # by prompt: the same prompts held out of both
        return zlib.crc32(f"sharegpt/{index(row)}".encode()) / 2**32 < args.held

    rows = {k: head_data.load_rows(work / k) for k in ("own", "forced")}
    split = {k: ([r for r in v if held(r)], [r for r in v if not held(r)])
             for k, v in rows.items()}
    other = []
    if args.compare:
        other, _ = head_data.split_held(head_data.load_rows(Path(args.compare) / "features"),
                                        0.04)
    shipped = Path(builtin_init).parent / f"head-{TARGET_DEFAULT}.pt"
    weights = cache_dir_for(TARGET_DEFAULT) / "model.safetensors"
    vocab = int(head_artifact.target_config(weights.parent).vocab_size)
    art = head_artifact.load(shipped)
    embed, tokens = head_artifact.target_parts(None, weights, art.token_ids, torch.float32)
    frozen = head_train.Frozen(embed.float(), tokens,
                               head_train.kept_index(art.token_ids, vocab))
    cfg = head_train.TrainConfig(depth=2, epochs=args.epochs, lr=args.lr, bf16=True,
                                 log_every=10**9)
    sets = {"held-out own answers": split["own"][0],
            "held-out ShareGPT answers": split["forced"][0]}
    if other:
        sets[f"held-out of {args.compare}"] = other

    def scores(head) -> dict[str, list[float]]:
        return {name: [round(x, 4) for x in head_train.evaluate(head, frozen, s, cfg, 3)]
                for name, s in sets.items()}

    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": platform.processor() or platform.machine(),
              "command": " ".join(sys.argv), "prompts": len(own),
              "held_out_prompts": len(split["own"][0]),
              "tokens": {k: sum(len(r["tokens"]) for r in v) for k, v in rows.items()},
              "record_seconds": round(recorded, 1),
              "heads": {"shipped": scores(art.head(torch.float32))}}
    print(json.dumps(result["heads"]), flush=True)
    for name in ("own", "forced"):
        head = art.head(torch.float32).train()
        t1 = time.perf_counter()
        head_train.train(head, frozen, split[name][1], [], cfg, progress=False)
        result["heads"][f"fine-tuned on {name} answers"] = scores(head.eval())
        result[f"train_seconds_{name}"] = round(time.perf_counter() - t1, 1)
        print(name, json.dumps(result["heads"][f"fine-tuned on {name} answers"]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Own answers or the dataset's ({result['date']})", "",
             f"Machine: {result['machine']}, 2 threads. Command: `{result['command']}`", "",
             f"{len(own)} ShareGPT prompts (file index {min(own_ids)}-{max(own_ids)}), "
             f"{result['held_out_prompts']} held out; tokens recorded: own "
             f"{result['tokens']['own']}, ShareGPT {result['tokens']['forced']}; "
             f"{args.epochs} epochs at lr {args.lr} from the shipped head.", "",
             "Greedy agreement by depth (1 / 2 / 3), teacher-forced, answer positions:", "",
             "| head | " + " | ".join(sets) + " |", "| --- |" + " --- |" * len(sets)]
    for name, s in result["heads"].items():
        lines.append(f"| {name} | " + " | ".join(
            " / ".join(f"{x:.3f}" for x in s[k]) for k in sets) + " |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
