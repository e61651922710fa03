"""Draft heads compared on held-out examples none of them trained on (issue 65).

    .venv/bin/python experiments/head_compare.py --data /work/headdata/v1 \
        --heads h2.pt h3.pt --older-shards 14

A head trained on a smaller recording of the same folder may have trained on examples that
the grown folder holds out (the held-out split follows ids, `lab/head/data.split_held`, but
an older head may predate it): `--older-shards N` counts the examples of the manifest's first
N shards as seen by the older heads, and agreement is reported on the held-out examples
outside them, and on all held-out ones. Greedy agreement by depth, as `adaspec head train`
prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def main() -> int:
    import torch

    from adaspec.draft import head_artifact
    from adaspec.lab.head import data as head_data
    from adaspec.lab.head import train as head_train
    from adaspec.store.catalog import TARGET_DEFAULT
    from adaspec.store.loading import cache_dir_for

    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="a folder `adaspec head data` wrote")
    p.add_argument("--heads", nargs="+", required=True)
    p.add_argument("--older-shards", type=int, default=0,
                   help="the first N shards' examples count as seen by the older heads")
    p.add_argument("--held", type=float, default=0.04, help="as `adaspec head train --held`")
    p.add_argument("--target", default=TARGET_DEFAULT)
    args = p.parse_args()

    features = Path(args.data) / "features"
    rows = head_data.load_rows(features)
    held, _ = head_data.split_held(rows, args.held)
    manifest = json.loads((features / "manifest.json").read_text())
    seen = {i for s in manifest["shards"][: args.older_shards] for i in s["examples"]}
    unseen = [r for r in held if r["id"] not in seen]
    print(f"{len(held)} held out, {len(unseen)} of them outside the first "
          f"{args.older_shards} shards")
    weights = cache_dir_for(args.target) / "model.safetensors"
    vocab = int(head_artifact.target_config(weights.parent).vocab_size)
    cfg = head_train.TrainConfig(depth=2)
    for path in args.heads:
        art = head_artifact.load(path)
        embed, tokens = head_artifact.target_parts(None, weights, art.token_ids, torch.float32)
        frozen = head_train.Frozen(embed.float(), tokens,
                                   head_train.kept_index(art.token_ids, vocab))
        for label, subset in (("unseen", unseen), ("all held out", held)):
            acc = head_train.evaluate(art.head(torch.float32), frozen, subset, cfg, 3)
            print(f"{path}: {label}: " + " / ".join(f"{a:.3f}" for a in acc), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
