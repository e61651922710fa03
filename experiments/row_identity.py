"""Does a row score the same wherever it is computed (issue 63, part 1)? The real target on
ik_llama.cpp: the single-sequence context `adaspec generate` runs against the multi-sequence
context `adaspec serve` runs by default (its slots and kept conversations), bit for bit.

For each prompt (held-out chat prompts, the chat template applied): plain decoding in the
single-sequence context gives the reference, one lone row a call (`--tokens` tokens). Then
the same prompt and continuation in a slot of the server's context, other slots holding
other prompts, scored four ways: lone rows (plain decoding in a server), blocks of `--block`
tokens (verification of a draft), each token beside the other slots' rows in one call (a
batched round), and blocks after the prompt was copied from another slot (a shared prefix).
Per way: rows compared, rows bit for bit equal, the largest logit difference, and rows whose
argmax differs. Writes row_identity.json and row_identity.md under --out.

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/row_identity.py \\
        --out experiments/results/row-identity-<machine>
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from serve_path import held_out  # noqa: E402

from adaspec.backends.load import load_backends  # noqa: E402
from adaspec.backends.sequences import ALL, forward_together  # noqa: E402
from adaspec.lab.bench.machine import describe_machine  # noqa: E402
from adaspec.serve.config import AUTO_SLOTS, KEPT_PER_SLOT  # noqa: E402
from adaspec.store.catalog import TARGET_DEFAULT  # noqa: E402


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    same = [bool(torch.equal(g, w)) for g, w in zip(got, want, strict=True)]
    return {"rows": len(same), "equal": sum(same),
            "max_diff": float((got - want).abs().max()) if len(same) else 0.0,
            "argmax_differs": int((got.argmax(-1) != want.argmax(-1)).sum())}


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--per-suite", type=int, default=2, help="prompts of each category")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--out", default="experiments/results/row-identity")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sequences = KEPT_PER_SLOT * AUTO_SLOTS  # `adaspec serve`'s default slots
    single, tok, _, _ = load_backends(TARGET_DEFAULT, None, "bfloat16", "ik", "ik")
    multi, _, _, _ = load_backends(TARGET_DEFAULT, None, "bfloat16", "ik", "ik",
                                   sequences=sequences + 1)
    views = multi.sequences(sequences)
    prompts = [chat_ids(tok, q["text"]) for q in held_out(args.per_suite, 1500)]
    ways: dict[str, list[dict]] = {"lone": [], "blocks": [], "beside others": [],
                                   "blocks after a copied prefix": []}
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        want = [single.prefill(torch.tensor(ids)).logits[-1:]]
        cont: list[int] = []
        for _ in range(args.tokens):
            cont.append(int(want[-1].argmax()))
            want.append(single.forward(torch.tensor(cont[-1:])).logits)
        single.reset()
        ref = torch.cat(want[1:])  # row j: after ids + cont[: j + 1]
        view = views[(3 * i + 5) % sequences]
        others = [v for v in views if v is not view][:3]
        for j, v in enumerate(others):
            v.reset()
            v.prefill(torch.tensor(prompts[(i + j + 1) % len(prompts)]))
        view.reset()
        view.prefill(torch.tensor(ids))
        rows = [view.forward(torch.tensor([t])).logits for t in cont]
        ways["lone"].append(compare(torch.cat(rows), ref))
        view.truncate(len(ids))
        rows = [view.forward(torch.tensor(cont[s:s + args.block])).logits
                for s in range(0, len(cont), args.block)]
        ways["blocks"].append(compare(torch.cat(rows), ref))
        view.truncate(len(ids))
        rows = []
        for j, t in enumerate(cont):
            got = forward_together([(view, [t], ALL)] + [(v, [100 + j], ALL) for v in others])
            rows.append(got[0])
        ways["beside others"].append(compare(torch.cat(rows), ref))
        donor, taker = view, others[0]
        donor.truncate(len(ids))
        taker.reset()
        # takes the prompt from the donor's region (`reuse` bounds a sibling's share too)
        shared = taker.shared_tokens
        rest = taker.plan_prefill(ids + cont[:1], len(ids))
        assert rest == cont[:1] and taker.shared_tokens - shared == len(ids), \
            f"the prompt was not taken from the donor ({len(rest)} tokens left to feed)"
        rows = [forward_together([(taker, cont[s:s + args.block], ALL)])[0]
                for s in range(0, len(cont), args.block)]
        ways["blocks after a copied prefix"].append(compare(torch.cat(rows), ref))
        print(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(
            f"{k} {v[-1]['equal']}/{v[-1]['rows']}" for k, v in ways.items()), flush=True)
    totals = {k: {"rows": sum(r["rows"] for r in v), "equal": sum(r["equal"] for r in v),
                  "max_diff": max(r["max_diff"] for r in v),
                  "argmax_differs": sum(r["argmax_differs"] for r in v)} for k, v in ways.items()}
    run = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
           "machine": describe_machine(), "single_kind": single.kind, "multi_kind": multi.kind,
           "sequences": sequences, "prompts": len(prompts), "tokens": args.tokens,
           "block": args.block, "seconds": round(time.perf_counter() - t0, 1),
           "totals": totals, "per_prompt": ways}
    (out / "row_identity.json").write_text(json.dumps(run, indent=1))
    lines = [f"# A row wherever it is computed ({run['date']})", "",
             f"Machine: {run['machine']}", "", f"Command: `{run['command']}`", "",
             f"Reference: plain decoding in the single-sequence context ({single.kind}), "
             f"{len(prompts)} held-out chat prompts x {args.tokens} tokens. Compared: a slot "
             f"of the server's default context ({multi.kind}, {sequences} slots), other slots "
             "holding other prompts.", "",
             "| scored as | rows | bit for bit equal | largest logit difference | argmax differs |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for k, v in totals.items():
        lines.append(f"| {k} | {v['rows']} | {v['equal']} | {v['max_diff']:.3g} | "
                     f"{v['argmax_differs']} |")
    (out / "row_identity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    for b in (single, multi):
        b.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
