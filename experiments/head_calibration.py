"""How well a draft head's confidence predicts its acceptance (issue 65), on held-out examples.

    .venv/bin/python experiments/head_calibration.py --data /work/headdata/v1 \
        --heads builtin /work/h4/h4.pt --out experiments/results/head-calibration-xeon-amx

Per depth (1-3, each given the drafts before it right, as `adaspec head train` reports
agreement), the head's top probability over its kept tokens in buckets of 0.1 against how
often its top token is the target's; then what a gate "draft only where the top probability
is at least t" would save per step on this machine's prices (a target step `--step-ms`, one
more verified row `--row-ms`, a head step `--head-ms`; the defaults are the Xeon cost profile
and the head's in-engine step, docs/head.md), labelled *predicted*. A calibrated head
(probability ~ acceptance) can carry its confidence as the batch's acceptance estimate
(`Proposal.accept`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

EDGES = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.01]
GATES = [0.0, 0.1, 0.2, 0.25, 0.3, 0.4, 0.5]


def main() -> int:
    import torch

    from adaspec.draft import head_artifact
    from adaspec.lab.head import data as head_data
    from adaspec.lab.head import train as head_train
    from adaspec.store.catalog import TARGET_DEFAULT
    from adaspec.store.loading import cache_dir_for

    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="a folder `adaspec head data` wrote")
    p.add_argument("--heads", nargs="+", default=["builtin"],
                   help="head files; 'builtin': the one shipped for the target")
    p.add_argument("--held", type=float, default=0.04, help="as `adaspec head train --held`")
    p.add_argument("--step-ms", type=float, default=52.5)
    p.add_argument("--row-ms", type=float, default=9.2)
    p.add_argument("--head-ms", type=float, default=5.3)
    p.add_argument("--out", default="")
    args = p.parse_args()

    rows = head_data.load_rows(Path(args.data) / "features")
    held, _ = head_data.split_held(rows, args.held)
    weights = cache_dir_for(TARGET_DEFAULT) / "model.safetensors"
    vocab = int(head_artifact.target_config(weights.parent).vocab_size)
    cfg = head_train.TrainConfig(depth=2)
    report: dict = {"data": args.data, "held_out_examples": len(held),
                    "prices_ms": {"step": args.step_ms, "row": args.row_ms,
                                  "head": args.head_ms}, "heads": {}}
    for name in args.heads:
        path = head_artifact.builtin_for(TARGET_DEFAULT) if name == "builtin" else Path(name)
        assert path is not None
        art = head_artifact.load(path)
        embed, tokens = head_artifact.target_parts(None, weights, art.token_ids, torch.float32)
        frozen = head_train.Frozen(embed.float(), tokens,
                                   head_train.kept_index(art.token_ids, vocab))
        head = art.head(torch.float32)
        probs: list[list[torch.Tensor]] = [[], [], []]
        hits: list[list[torch.Tensor]] = [[], [], []]
        with torch.no_grad():
            for row in held:
                start = max(0, int(row["prompt_len"]) - 1)  # answer positions only
                outs = head_train.unrolled(head, frozen, row, cfg, 3)
                greedy = frozen.index[row["top_ids"].long()[1:, 0]]
                for d, h in enumerate(outs):
                    top, pred = torch.softmax(frozen.token_head(h), -1).max(1)
                    sel = torch.arange(h.shape[0]) >= max(d, start)
                    probs[d].append(top[sel])
                    hits[d].append(((pred == greedy) & (greedy >= 0))[sel])
        depths = []
        for d in range(3):
            q = torch.cat(probs[d]).double()
            ok = torch.cat(hits[d]).double()
            buckets = []
            for lo, hi in zip(EDGES, EDGES[1:], strict=False):
                m = (q >= lo) & (q < hi)
                if m.any():
                    buckets.append({"from": lo, "to": min(hi, 1.0),
                                    "share": float(m.double().mean()),
                                    "mean_probability": float(q[m].mean()),
                                    "agreement": float(ok[m].mean())})
            gates = []
            for t in GATES:
                m = (q >= t).double()
                saved = float((ok * m).mean()) * args.step_ms - float(m.mean()) * args.row_ms
                gates.append({"gate": t, "drafted_share": float(m.mean()),
                              "agreement_drafted": float((ok * m).sum() / m.sum().clamp(min=1)),
                              "predicted_ms_saved_per_step": saved - args.head_ms})
            depths.append({"depth": d + 1, "positions": len(q), "agreement": float(ok.mean()),
                           "mean_probability": float(q.mean()), "buckets": buckets,
                           "gates": gates})
        report["heads"][name] = depths
        print(_table(name, depths), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report["command"] = " ".join(sys.argv)
        (out / "summary.json").write_text(json.dumps(report, indent=1))
        (out / "summary.md").write_text(
            f"`{report['command']}`, {len(held)} held-out examples\n\n"
            + "\n".join(_table(n, d) for n, d in report["heads"].items()))
    return 0


def _table(name: str, depths: list[dict]) -> str:
    lines = [f"### {name}", "", "| depth | top probability | share | mean probability | "
             "agreement |", "| ---: | --- | ---: | ---: | ---: |"]
    for d in depths:
        for b in d["buckets"]:
            lines.append(f"| {d['depth']} | {b['from']:.1f}-{b['to']:.1f} | {b['share']:.3f} | "
                         f"{b['mean_probability']:.3f} | {b['agreement']:.3f} |")
        lines.append(f"| {d['depth']} | all | 1 | {d['mean_probability']:.3f} | "
                     f"{d['agreement']:.3f} |")
    lines += ["", "| depth | gate | drafted share | agreement where drafted | *predicted* ms "
              "saved a step, head step paid |", "| ---: | ---: | ---: | ---: | ---: |"]
    for d in depths:
        for g in d["gates"]:
            lines.append(f"| {d['depth']} | {g['gate']:.2f} | {g['drafted_share']:.3f} | "
                         f"{g['agreement_drafted']:.3f} | "
                         f"{g['predicted_ms_saved_per_step']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
