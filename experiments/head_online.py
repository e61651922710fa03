"""Does the draft head gain from learning on what it serves (OSD on the head, issue 66)?

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/head_online.py \
        --data /work/headdata/v1 --from-shard 52 --out experiments/results/head-online-<machine>

A prequential run over a stream of recorded requests the shipped head never trained on (the
shards from `--from-shard` on: examples recorded after it was trained, in the order recorded,
so one source after another, as domains arrive at a server). Each request is first drafted
by the head last published (every `--interval` requests; its greedy agreement with the
target's top token by depth, over the answer's positions), then learned from
(`online/head.py` `HeadLearner`, on the answer's positions and the target's top-8 there,
what a server's `HeadRecorder` keeps). The frozen head on the same stream is the baseline.
No request is scored by a head that has seen it. Writes summary.json and summary.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def source(row: dict, categories: dict[str, str]) -> str:
    """The request's domain: its prompt set (Spec-Bench's: its category)."""
    rid = str(row["id"])
    return categories.get(rid) or rid.split("/", 1)[0]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, nargs="+",
                   help="recordings streamed one after another (DIR, or DIR@N: from its "
                        "shard N on)")
    p.add_argument("--from-shard", type=int, default=0,
                   help="the first shard recorded after the head was trained (a DIR "
                        "without @N)")
    p.add_argument("--lr", default="5e-5,2e-4", help="learning rates to run, comma-separated")
    p.add_argument("--replay", type=int, default=1)
    p.add_argument("--steps", type=int, default=1, help="passes over each request")
    p.add_argument("--interval", type=int, default=16,
                   help="requests between publications: requests are drafted by the head "
                        "last published, as a server's are (1: the head as it learns)")
    p.add_argument("--depth", type=int, default=3, help="agreement depths reported")
    p.add_argument("--limit", type=int, default=0, help="stream length (0: all)")
    p.add_argument("--grow", default="0",
                   help="runs' kept-token growth budgets, comma-separated, one per --lr "
                   "(or one for all): the target's choices outside the kept set join it "
                   "once chosen --grow-min times (online/head.py KeptGrowth)")
    p.add_argument("--grow-min", type=int, default=3)
    p.add_argument("--window", type=int, default=50,
                   help="requests at each end of the stream compared")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import copy

    import torch

    from adaspec.draft import head_artifact
    from adaspec.draft.head_loss import Frozen, kept_index
    from adaspec.lab.bench import suites
    from adaspec.online.head import HeadLearnConfig, HeadLearner
    from adaspec.store.catalog import TARGET_DEFAULT
    from adaspec.store.loading import cache_dir_for

    torch.manual_seed(0)
    stream = []
    for data in args.data:
        folder, _, first = data.partition("@")
        root = Path(folder) / "features"
        if not (root / "manifest.json").is_file():
            root = Path(folder)  # a recording's features folder itself
        manifest = json.loads((root / "manifest.json").read_text())
        stream += [r for s in manifest["shards"][int(first or args.from_shard):]
                   for r in torch.load(root / s["file"], weights_only=True)]
    if args.limit:
        stream = stream[: args.limit]
    if not stream:
        raise SystemExit(f"no examples recorded in {args.data}")
    categories = {p.id: f"spec-bench/{p.category}" for p in suites.spec_bench(None)}
    path = head_artifact.builtin_for(TARGET_DEFAULT)
    assert path is not None
    art = head_artifact.load(path)
    weights = cache_dir_for(TARGET_DEFAULT) / "model.safetensors"
    embed, tokens = head_artifact.target_parts(None, weights, art.token_ids)
    rows = head_artifact.target_rows(None, weights)
    frozen = Frozen(embed.float(), tokens, kept_index(art.token_ids, tokens.vocab))
    head = art.head()

    def served(row: dict) -> dict:
        """The row as a server records it (`online/head.py` `HeadRecorder`): the answer's
        positions, from the first generated token on, with the target's top-8 there."""
        start = int(row["prompt_len"])
        return {k: row[k][start:] for k in ("tokens", "final", "top_ids", "top_probs")} | {
            "prompt_len": 0}

    runs: dict[str, dict] = {}
    rates = args.lr.split(",")
    grows = [int(g) for g in args.grow.split(",")]
    grows = grows * len(rates) if len(grows) == 1 else grows
    if len(grows) != len(rates):
        raise SystemExit("--grow: one budget, or one per --lr")
    for lr, grow in [("frozen", 0), *zip(rates, grows, strict=True)]:
        name = lr if not grow else f"{lr} grow {grow}"
        learner = HeadLearner(head, frozen, HeadLearnConfig(
            lr=float(lr) if lr != "frozen" else 1e-9, replay=args.replay, steps=args.steps,
            grow=grow, grow_min=args.grow_min), rows=rows)
        by: dict[str, list[list[int]]] = defaultdict(lambda: [[0, 0] for _ in range(args.depth)])
        halves: list[list[int]] = [[0, 0], [0, 0]]
        each: list[tuple[int, int]] = []  # per request, depth 1
        t0 = time.perf_counter()
        published = copy.deepcopy(learner.student).eval()
        kept = learner.frozen  # the kept tokens published with it
        for i, row in enumerate(stream):
            req = served(row)
            # drafted by the head last published, scored against the target's own top token
            hits = learner.agreement(row, args.depth, head=published, frozen=kept)
            for d, (a, b) in enumerate(hits):
                for key in (source(row, categories), "all"):
                    by[key][d][0] += a
                    by[key][d][1] += b
            half = halves[0 if i < len(stream) / 2 else 1]
            half[0] += hits[0][0]
            half[1] += hits[0][1]
            each.append(hits[0])
            if lr != "frozen":
                learner.learn(req)
                if (i + 1) % args.interval == 0:
                    published = copy.deepcopy(learner.student).eval()
                    kept = learner.frozen
            if (i + 1) % 50 == 0:
                print(f"{name}: {i + 1}/{len(stream)} requests, depth-1 agreement so far "
                      f"{by['all'][0][0] / max(1, by['all'][0][1]):.4f}", flush=True)
        runs[name] = {
            "agreement": {k: [round(a / max(1, b), 4) for a, b in v] for k, v in by.items()},
            "positions": {k: v[0][1] for k, v in by.items()},
            "halves_depth1": [round(a / max(1, b), 4) for a, b in halves],
            # the first and the last `--window` requests (OSD's goal: +0.05 from one to the
            # other on a stream of one kind)
            "window_depth1": [round(sum(a for a, _ in w) / max(1, sum(b for _, b in w)), 4)
                              for w in (each[: args.window], each[-args.window:])],
            "seconds": round(time.perf_counter() - t0, 1),
            "steps": learner.steps,
            "kept_added": len(kept.token_head.token_ids) - len(art.token_ids),
        }
        print(name, json.dumps(runs[name]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor(),
               "stream": len(stream), "from_shard": args.from_shard, "replay": args.replay,
               "interval": args.interval, "steps": args.steps,
               "command": " ".join(sys.argv), "runs": runs}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    domains = sorted(runs["frozen"]["agreement"], key=lambda k: (k == "all", k))
    lines = [f"# The draft head learning on its stream (prequential), {summary['date']}", "",
             f"`{summary['command']}`", "",
             f"{len(stream)} requests the shipped head never trained on, in the order "
             "recorded; each drafted by the head last published (every "
             f"{args.interval} requests), which never learned from it. Greedy agreement "
             "with the target's top token at depth 1 (in brackets depth 2 / 3).", "",
             "| domain | positions | " + " | ".join(runs) + " |",
             "| --- | ---: |" + " ---: |" * len(runs)]
    for dom in domains:
        cells = []
        for r in runs.values():
            a = r["agreement"][dom]
            cells.append(f"{a[0]:.3f} ({' / '.join(f'{x:.3f}' for x in a[1:])})")
        lines.append(f"| {dom} | {runs['frozen']['positions'][dom]} | " + " | ".join(cells)
                     + " |")
    lines += ["", "Depth-1 agreement, first half of the stream / second half: "
              + "; ".join(f"{k} {v['halves_depth1'][0]:.3f} / {v['halves_depth1'][1]:.3f}"
                          for k, v in runs.items()),
              "", f"Depth-1 agreement, first {args.window} requests / last {args.window}: "
              + "; ".join(f"{k} {v['window_depth1'][0]:.3f} / {v['window_depth1'][1]:.3f}"
                          for k, v in runs.items()),
              "", "Tokens added to the kept set: "
              + ", ".join(f"{k} {v['kept_added']}" for k, v in runs.items()),
              "", "Seconds per run (scoring and learning): "
              + ", ".join(f"{k} {v['seconds']}" for k, v in runs.items())]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
