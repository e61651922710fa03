"""Which multi-candidate rule accepts most (issue 66, part 2: "MCSS without replacement >=
MCSS >= naive in acceptance, as in the paper"), on the draft head's own distributions, with
the texts held fixed.

In an engine run at T > 0 every method samples its own text, so acceptance compared across
methods mixes the rule with what each text asked of the head. Here the positions are fixed:
held-out examples `adaspec head data` recorded (the target's final-normed states of a real
text), the head's depth-1 distribution q at each position (T = 1) and the target's p there
(its output head over the recorded state, T = 1). At every position each rule draws its W
candidates from q (i.i.d. for MCSS, without replacement for MCSS-wor and the naive rule)
and verifies them against p, `--draws` times: the share of verdicts that keep a candidate
is the rule's acceptance at width W. W = 1 is speculative sampling for every rule. The
tokens the head never proposes (q = 0) are one bucket of p (exact: no rule proposes them,
and each residual treats them alike).

    .venv/bin/python experiments/mcss_acceptance.py --data /work/headdata/rt1 \\
        --out experiments/results/head-tree-epyc-avx512/mcss
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

RULES = ("mcss-wor", "mcss", "mcns")


def main() -> int:
    import torch
    from safetensors import safe_open

    from adaspec.core.sampling import SamplingParams, process_logits
    from adaspec.draft import head_artifact
    from adaspec.draft.model_tree import draw_children
    from adaspec.lab.head import data as head_data
    from adaspec.lab.head import train as head_train
    from adaspec.store.catalog import TARGET_DEFAULT
    from adaspec.store.loading import cache_dir_for
    from adaspec.verify.multi_candidate import mcns_step, mcss_step

    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="a folder `adaspec head data` wrote")
    p.add_argument("--held", type=float, default=0.04, help="as `adaspec head train --held`")
    p.add_argument("--examples", type=int, default=8)
    p.add_argument("--widths", default="1,2,3,4")
    p.add_argument("--draws", type=int, default=40)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    args = p.parse_args()

    rows = head_data.load_rows(Path(args.data) / "features")
    held = head_data.split_held(rows, args.held)[0][: args.examples]
    weights = cache_dir_for(TARGET_DEFAULT) / "model.safetensors"
    path = head_artifact.builtin_for(TARGET_DEFAULT)
    assert path is not None
    art = head_artifact.load(path)
    with safe_open(str(weights), framework="pt") as f:
        out_name = head_artifact.OUTPUT if head_artifact.OUTPUT in set(f.keys()) \
            else head_artifact.EMBED
        output = f.get_tensor(out_name).float()  # [V, H]
    vocab = output.shape[0]
    embed, tokens = head_artifact.target_parts(None, weights, art.token_ids, torch.float32)
    frozen = head_train.Frozen(embed.float(), tokens, head_train.kept_index(art.token_ids, vocab))
    head = art.head(torch.float32)
    kept = art.token_ids.long()
    params = SamplingParams(args.temperature)
    qs, ps = [], []
    with torch.no_grad():
        for row in held:
            start = max(0, int(row["prompt_len"]) - 1)  # answer positions only
            h = head_train.unrolled(head, frozen, row, head_train.TrainConfig(depth=1), 1)[0]
            # the head's output at input i (state i, token i + 1) drafts token i + 2: the
            # target's distribution there comes from its state at i + 1
            q = process_logits(frozen.token_head(h)[start:], params)  # [T - 1, N] over kept
            states = row["final"].float()[1:][start : start + q.shape[0]]
            full = process_logits(states @ output.T, params)  # [T - 1, V]
            inside = full[:, kept]
            ps.append(torch.cat([inside, (1 - inside.sum(1, keepdim=True)).clamp(min=0)], 1))
            qs.append(torch.cat([q, torch.zeros(q.shape[0], 1)], 1))
    q_all, p_all = torch.cat(qs), torch.cat(ps)
    positions = q_all.shape[0]
    gen = torch.Generator().manual_seed(args.seed)
    table: dict[str, dict[int, float]] = {r: {} for r in RULES}
    chunk = max(1, 2048 // args.draws)  # positions a batch (draws rows each)
    for width in (int(w) for w in args.widths.split(",")):
        for rule in RULES:
            hits = 0
            for a in range(0, positions, chunk):
                q = q_all[a : a + chunk].repeat_interleave(args.draws, 0)
                pp = p_all[a : a + chunk].repeat_interleave(args.draws, 0)
                cands = torch.tensor(draw_children(q, width, gen, rule == "mcss"))
                if rule == "mcns":
                    choice, _ = mcns_step(cands, q, pp, gen)
                else:
                    choice, _ = mcss_step(cands, q, pp, gen, replacement=rule == "mcss")
                hits += int((choice >= 0).sum())
            table[rule][width] = hits / (positions * args.draws)
        print(f"W={width}: " + "  ".join(f"{r} {table[r][width]:.4f}" for r in RULES),
              flush=True)
    lines = [f"`{' '.join(sys.argv)}`: {len(held)} held-out examples, {positions} answer "
             f"positions x {args.draws} draws each, T = {args.temperature}", "",
             "| candidates W | " + " | ".join(RULES) + " |",
             "| ---: | " + " | ".join("---:" for _ in RULES) + " |"]
    for width in table[RULES[0]]:
        lines.append(f"| {width} | " + " | ".join(f"{table[r][width]:.3f}" for r in RULES)
                     + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.md").write_text(text)
        (out / "summary.json").write_text(json.dumps(
            {"command": " ".join(sys.argv), "positions": positions,
             "acceptance": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
