"""The verification slack continuous batching would share (issue 33), measured on
ik_llama.cpp: what one target call costs when it carries one token for each of B requests
(B sequences in one batch, each with its own KV entries), against one request's chain of B
tokens and against B separate single-token calls.

Eight different prompts are prefilled into eight sequences of one context (`n_seq_max` 8,
one KV cache shared by the slots), then, in interleaved rounds, each shape is timed as one
`llama_decode` and rolled back (`llama_kv_cache_seq_rm`), with flash attention as `serve
--max-batch` runs it (`ikllama.multi_sequence_flash`). Medians of the rounds. Writes
batch_slack.json / batch_slack.md.

    .venv/bin/python experiments/batch_slack.py --out experiments/results/batch-slack-epyc
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from ik_raw import suite_sequences, write_results  # noqa: E402

from adaspec.backends.weights import llama_threads  # noqa: E402
from adaspec.lab.bench.machine import describe_machine  # noqa: E402
from adaspec.store.catalog import TARGET_DEFAULT  # noqa: E402

SLOTS = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=TARGET_DEFAULT)
    ap.add_argument("--sizes", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="experiments/results/batch-slack")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    assert max(sizes) <= SLOTS

    # flash attention as `serve --max-batch` runs this library
    api, lib, model, ctx = suite_sequences(args.target, SLOTS)
    flash = ctx.flash

    def decode(rows: list[tuple[int, int, int]]) -> float:
        """rows: (sequence, position, token), logits for every row; seconds."""
        return ctx.decode(rows, every_row=True)[0]

    lengths = ctx.lengths

    shapes = {}
    for b in sizes:
        shapes[f"{b} requests x 1 token"] = [(s, lengths[s], 13) for s in range(b)]
        shapes[f"1 request x {b} tokens"] = [(0, lengths[0] + i, 13 + i) for i in range(b)]
    times: dict[str, list[float]] = {name: [] for name in shapes}
    for _ in range(args.rounds + 1):  # the first round warms up
        for name, rows in shapes.items():
            times[name].append(decode(rows))
            ctx.roll_back()
    ms = {name: 1000 * statistics.median(t[1:]) for name, t in times.items()}
    one = ms["1 requests x 1 token"]
    table = [{"shape": name, "ms": round(v, 2), "single_token_passes": round(v / one, 2)}
             for name, v in ms.items()]
    record = {"target": args.target, "runtime": f"ik_llama.cpp ({api.adaspec_build})",
              "flash_attention": flash, "machine": describe_machine(), "rounds": args.rounds,
              "rows": table,
              "prompt_tokens": lengths}
    lines = [f"# One target call, several requests or one chain ({args.target}, "
             f"{record['runtime']}, {llama_threads()} threads, flash attention "
             f"{'on' if flash else 'off'})", "",
             "| shape | ms | single-token passes |", "| --- | ---: | ---: |"]
    lines += [f"| {r['shape']} | {r['ms']:.1f} | {r['single_token_passes']:.2f} |"
              for r in table]
    write_results(args.out, "batch_slack", record, lines)
    ctx.close()
    lib.llama_free_model(model)


if __name__ == "__main__":
    main()
