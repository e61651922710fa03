"""Can a second layer on the draft head pay as an early-exit draft (issue 66, part 5: S2D on
the head)? The shipped head is exit 1, frozen; a second decoder layer reading exit 1's output
is exit 2, its output projections started at zero (so exit 2 starts equal to exit 1) and
trained on recorded target features; then, on held-out prompts, depth-1 agreement with the
target of exit 1, exit 2, and the per-token mix that takes exit 1's token where its top
probability is at least a threshold and runs exit 2 otherwise (S2D's rule).

    .venv/bin/python experiments/head_exits.py --data /work/headdata/rt1 \
        --data /work/headdata/own1/rec/own --out experiments/results/head-exits-<machine>

Training rows: every example not held out; held out: by prompt hash, and only prompts the
shipped head never trained on (ids `sharegpt-own/*`, file index >= 7,302) where
`--held-kinds` says so.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def main() -> int:
    import torch
    from tqdm import tqdm

    from adaspec.draft import head_artifact
    from adaspec.draft.head_loss import Frozen, kept_index
    from adaspec.draft.head_model import HeadLayer
    from adaspec.lab.head import data as head_data
    from adaspec.store.catalog import TARGET_DEFAULT
    from adaspec.store.loading import cache_dir_for

    p = argparse.ArgumentParser()
    p.add_argument("--data", action="append", required=True)
    p.add_argument("--held", type=float, default=0.2)
    p.add_argument("--held-kinds", default="sharegpt-own,enfr,wmt-own",
                   help="id prefixes eligible for the held-out set")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--mlp", type=int, default=1024)
    p.add_argument("--feature-weight", type=float, default=0.1)
    p.add_argument("--soft", action="store_true",
                   help="train exit 1 (the head) too, both exits' losses summed (SoFT)")
    p.add_argument("--save", default="", help="write the exits here")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(0)

    art = head_artifact.load(head_artifact.builtin_for(TARGET_DEFAULT))
    embed, tokens = head_artifact.target_parts(
        None, cache_dir_for(TARGET_DEFAULT) / "model.safetensors", art.token_ids,
        torch.float32)
    frozen = Frozen(embed, tokens, kept_index(art.token_ids, tokens.vocab))
    head = art.head(torch.float32).eval()

    kinds = tuple(k for k in args.held_kinds.split(",") if k)

    def held(row: dict) -> bool:
        rid = str(row["id"])
        return (rid.startswith(kinds)
                and zlib.crc32(rid.encode()) / 2**32 < args.held)

    rows = [r for d in args.data for r in head_data.load_rows(Path(d))]
    test = [r for r in rows if held(r)]
    train = [r for r in rows if not held(r)]
    print(f"{len(train)} training examples, {len(test)} held out", flush=True)

    def exit1(row: dict) -> torch.Tensor:
        feats = row["final"].float()[:-1][None]
        ids = row["tokens"].long()[1:]
        n = ids.shape[0]
        with torch.no_grad():
            out, _ = head(feats, embed[ids].float()[None], torch.arange(n)[None])
        return out[0]  # [n, H]

    def data_of(row: dict) -> dict:
        top_ids = row["top_ids"].long()[1:]
        kept = frozen.index[top_ids]
        top_p = row["top_probs"].float()[1:]
        return {"h1": exit1(row).to(torch.bfloat16), "kept": kept, "row": row if args.soft
                else None,
                "weight": torch.where(kept >= 0, top_p, torch.zeros_like(top_p)),
                "feat": row["final"].to(torch.bfloat16)[1:],
                "start": max(0, int(row["prompt_len"]) - 1),
                "known": row["top_probs"][1:, 0] > 0}

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train_d = [data_of(r) for r in tqdm(train, desc="exit 1 outputs", mininterval=30)]
    test_d = [data_of(r) for r in test]
    for d, r in zip(test_d, test, strict=True):
        d["kind"] = next(i for i, k in enumerate(kinds) if str(r["id"]).startswith(k))
        d["row"] = r
    del rows, train, test
    print(f"exit 1 outputs: {time.perf_counter() - t0:.0f} s", flush=True)

    layer = HeadLayer(head.cfg if args.mlp == head.cfg.intermediate else
                      type(head.cfg)(**{**head.cfg.to_json(), "intermediate": args.mlp}))
    with torch.no_grad():  # exit 2 starts as exit 1
        layer.o.weight.zero_()
        layer.down.weight.zero_()
    trained = list(layer.parameters())
    if args.soft:
        for q in head.parameters():
            q.requires_grad_(True)
        trained += list(head.parameters())
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(train_d)

    def rate(step: int) -> float:
        return min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(step, total)
                                                               / total))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)


    def exits(d: dict, train: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Exit 1's and exit 2's outputs [n, H] (exit 1 recomputed where it trains)."""
        if args.soft and train:
            row = d["row"]
            ids = row["tokens"].long()[1:]
            h1, _ = head(row["final"].float()[:-1][None], embed[ids].float()[None],
                         torch.arange(ids.shape[0])[None])
            h1 = h1[0]
        elif args.soft:
            h1 = exit1(d["row"])
        else:
            h1 = d["h1"].float()
        out, _ = layer(h1[None], torch.arange(h1.shape[0])[None])
        return h1, out[0]

    def loss_of(d: dict, h: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(frozen.token_head(h), -1)
        ce = -(d["weight"] * logp.gather(1, d["kept"].clamp(min=0))).sum(1)
        feat = torch.nn.functional.smooth_l1_loss(
            h, d["feat"].float(), reduction="none").mean(1)
        return (ce + args.feature_weight * feat).mean()

    def evaluate() -> dict:
        rows_out = []  # per answer position: p1 max, exit-1 hit, exit-2 hit
        with torch.no_grad():
            for d in test_d:
                labels = d["kept"][:, 0]
                n = labels.shape[0]
                sel = (torch.arange(n) >= d["start"]) & d["known"]
                h1, h2 = exits(d)
                l1 = frozen.token_head(h1)
                l2 = frozen.token_head(h2)
                p1 = torch.softmax(l1, -1).max(-1).values
                p2 = torch.softmax(l2, -1).max(-1).values
                hit1 = (l1.argmax(-1) == labels) & (labels >= 0)
                hit2 = (l2.argmax(-1) == labels) & (labels >= 0)
                kind = torch.full_like(p1, float(d["kind"]))
                rows_out.append(torch.stack([p1, hit1.float(), hit2.float(), p2, kind],
                                            1)[sel])
        t = torch.cat(rows_out)
        torch.save(t, out_dir / "positions.pt")  # p1, hit1, hit2, p2, kind per position
        out = {"positions": int(t.shape[0]), "exit1": float(t[:, 1].mean()),
               "exit2": float(t[:, 2].mean()), "mix": {}}
        for tau in (0.3, 0.5, 0.6, 0.7, 0.8, 0.9):
            use1 = t[:, 0] >= tau
            acc = torch.where(use1, t[:, 1], t[:, 2]).mean()
            out["mix"][str(tau)] = {"agreement": float(acc),
                                    "exit2_share": float((~use1).float().mean())}
        # calibration of each exit (mean top probability vs hits)
        out["exit1_mean_p"] = float(t[:, 0].mean())
        out["exit2_mean_p"] = float(t[:, 3].mean())
        out["by_kind"] = {k: {"positions": int((t[:, 4] == i).sum()),
                              "exit1": float(t[t[:, 4] == i, 1].mean()),
                              "exit2": float(t[t[:, 4] == i, 2].mean())}
                          for i, k in enumerate(kinds) if (t[:, 4] == i).any()}
        return out

    report = {"before": evaluate(), "epochs": []}
    print("before:", json.dumps(report["before"]), flush=True)
    step = 0
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(train_d)).tolist()
        for i in tqdm(order, desc=f"epoch {epoch}", mininterval=60):
            d = train_d[i]
            h1, h2 = exits(d, train=True)
            loss = loss_of(d, h2)
            if args.soft:  # SoFT: every exit's loss
                loss = (loss + loss_of(d, h1)) / 2
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 0.5)
            opt.step()
            sched.step()
            step += 1
        ev = evaluate()
        ev["seconds"] = time.perf_counter() - t0
        report["epochs"].append(ev)
        print(f"epoch {epoch}:", json.dumps(ev), flush=True)

    out = out_dir
    report.update({
        "command": "python " + " ".join(sys.argv),
        "data": args.data, "train_examples": len(train_d), "held_out_examples": len(test_d),
        "train_tokens": sum(int(d["h1"].shape[0]) for d in train_d),
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "platform": platform.platform()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    (out / "exits.json").write_text(json.dumps(report, indent=1))
    if args.save:
        torch.save({"layer": layer.state_dict(), "config": layer.cfg.to_json(),
                    "head": head.state_dict() if args.soft else None}, args.save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
