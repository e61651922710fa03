"""One batched target call whose sequences carry different token counts (a request verifying
a draft beside requests stepping one token), against calls of one token a sequence with the
same total, on ik_llama.cpp as `serve --max-batch` runs it (issue 33).

Twelve prompts are prefilled into twelve sequences of one context, then each shape is timed
as one `llama_decode` and rolled back, in interleaved rounds; medians after two warm-up
rounds. Beside each, the server's batch cost curve (`cost.batch`, this machine's stored one)
prices the same call by (tokens, sequences): where the clock and the curve part, the batch
pricing verifies drafts that the clock says do not pay. Writes batch_ragged.json / .md.

    .venv/bin/python experiments/batch_ragged.py --out /tmp/batch-ragged
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from ik_raw import suite_sequences, write_results  # noqa: E402

from adaspec.lab.bench.machine import describe_machine  # noqa: E402
from adaspec.store.catalog import TARGET_DEFAULT  # noqa: E402

SLOTS = 12
SHAPES = {  # tokens each sequence feeds
    "8 x 1": [1] * 8, "9 x 1": [1] * 9, "2 + 7 x 1": [2] + [1] * 7,
    "11 x 1": [1] * 11, "4 + 7 x 1": [4] + [1] * 7, "2, 2, 2 + 5 x 1": [2, 2, 2] + [1] * 5,
    "12 x 1": [1] * 12, "5 + 7 x 1": [5] + [1] * 7,
}


def stored_curve() -> dict | None:
    """The batch cost curve this machine stored for the target (None: none yet)."""
    paths = sorted((Path.home() / ".cache/adaspec/profiles").glob(
        f"*{TARGET_DEFAULT}*-batch.json"))
    return json.loads(paths[-1].read_text())["curve"] if paths else None


def curve_ms(curve: dict, tokens: int, sequences: int) -> float | None:
    from adaspec.cost.profile import Curve

    return Curve(**curve)(tokens, sequences) if curve else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default="/tmp/batch-ragged")
    args = ap.parse_args()
    _, lib, model, ctx = suite_sequences(TARGET_DEFAULT, SLOTS)
    lengths = ctx.lengths

    def rows(counts: list[int]) -> list[tuple[int, int, int]]:
        return [(s, lengths[s] + i, 13 + i) for s, n in enumerate(counts) for i in range(n)]

    times: dict[str, list[float]] = {name: [] for name in SHAPES}
    for _ in range(args.rounds + 2):
        for name, counts in SHAPES.items():
            times[name].append(ctx.decode(rows(counts), every_row=True)[0])
            ctx.roll_back()
    curve = stored_curve()
    table = []
    for name, counts in SHAPES.items():
        ms = 1000 * statistics.median(times[name][2:])
        priced = curve_ms(curve, sum(counts), len(counts)) if curve else None
        table.append({"shape": name, "tokens": sum(counts), "sequences": len(counts),
                      "ms": round(ms, 1), "curve_ms": round(priced, 1) if priced else None})
    lines = [f"# Ragged and even batched calls ({TARGET_DEFAULT}, ik_llama.cpp)", "",
             "| sequences: tokens | tokens | ms (timed) | ms (curve, modelled) |",
             "| --- | ---: | ---: | ---: |"]
    lines += [f"| {r['shape']} | {r['tokens']} | {r['ms']} | {r['curve_ms']} |" for r in table]
    write_results(args.out, "batch_ragged", {"target": TARGET_DEFAULT,
                                             "machine": describe_machine(),
                                             "rounds": args.rounds, "rows": table}, lines)
    ctx.close()
    lib.llama_free_model(model)


if __name__ == "__main__":
    main()
