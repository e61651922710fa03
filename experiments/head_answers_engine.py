"""The target's own greedy answers to ShareGPT prompts through adaspec's engine (ik_llama.cpp,
`auto:use=ngram+head`: the text plain decoding gives), appended to OUT/answers.jsonl in the
format `adaspec head data` reads and resumes from (`{"id": "sharegpt-own/I", "answer_ids":
[...]}`). On a 2-vCPU AMD EPYC this took 3.9 s a prompt, where `head data`'s batched torch
`generate` took over 4 minutes for its first 20. Prompts of file index below 12,000 only
(DESIGN.md), of at most --max-prompt tokens (the recording keeps 320 tokens in all).

    .venv/bin/python experiments/head_answers_engine.py --out DIR --prompts 240 --start 7300
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def main() -> int:
    from adaspec.core.sampling import SamplingParams
    from adaspec.lab.head import data as head_data
    from adaspec.methods.build import load_generator
    from adaspec.store.catalog import TARGET_DEFAULT

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=240)
    p.add_argument("--start", type=int, default=7300, help="first ShareGPT file index")
    p.add_argument("--max-prompt", type=int, default=192)
    p.add_argument("--answer-tokens", type=int, default=128)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "answers.jsonl"
    done = ({json.loads(line)["id"] for line in path.read_text().splitlines()}
            if path.exists() else set())
    examples = head_data.training_examples(sharegpt_own=3 * args.prompts,
                                           sharegpt_own_from=args.start)
    engine = load_generator("auto:use=ngram+head", TARGET_DEFAULT, None, "bfloat16",
                            "fastest", "fastest", "auto")
    eos = 151645  # <|im_end|>: kept where the answer ended, as `own_answers` keeps it
    kept, t0 = len(done), time.time()
    for ex in examples:
        if kept >= args.prompts:
            break
        if ex.id in done:
            continue
        ids = head_data._prompt_ids(engine.tokenizer, ex.prompt)
        if len(ids) > args.max_prompt:
            continue
        kept += 1
        got = engine.generate(ids, args.answer_tokens, SamplingParams(temperature=0.0),
                              chat=False)
        answer = list(got.token_ids)
        if got.finish_reason == "eos" and (not answer or answer[-1] != eos):
            answer.append(eos)
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"id": ex.id, "answer_ids": answer}) + "\n")
        print(f"{kept}/{args.prompts} {ex.id} prompt {len(ids)} answer {len(answer)} "
              f"{got.finish_reason} {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
