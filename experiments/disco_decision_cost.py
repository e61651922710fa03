"""Cost of one DISCO decision (features of one logits row + classifier) on this machine.

Times `DiscoLength.keep_drafting` on random logits of the real vocabulary (151,936 tokens,
Qwen2.5) with a trained artifact's classifier, beside the route it replaced (log-softmax over
the row, top-k over that, entropy from it, the classifier called as a module), so both figures
come from the same run on the same rows. Median over --calls calls per thread count. Writes
decision_cost.json and decision_cost.md to --out. No model is loaded.

    OMP_NUM_THREADS=2 .venv/bin/python experiments/disco_decision_cost.py --threads 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from adaspec.control.disco import DiscoLength
from adaspec.control.disco_artifact import DiscoArtifact
from adaspec.control.disco_features import TOP_K, assemble, distribution_features
from adaspec.cost.cache import cpu_model

VOCAB = 151_936  # Qwen2.5 tokenizer, shared by the 1.5B target and the 0.5B draft
ROWS = 4  # distinct logits rows, taken in turn, so no call reuses the previous one's row


def previous_features(logits: torch.Tensor) -> torch.Tensor:
    """The feature route before issue 4's rework: a full log-softmax, a top-k over all of it
    and the entropy from the log-probabilities (the same features, slower)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(TOP_K, dim=-1).values.exp()
    entropy = -(logp.exp() * logp).nan_to_num().sum(dim=-1, keepdim=True)
    return torch.cat([top, entropy], dim=-1)


def previous_decision(art: DiscoArtifact, logits: torch.Tensor, position: int) -> bool:
    """One decision as it was made before: features above, then the classifier module."""
    with torch.inference_mode():
        x = assemble(previous_features(logits), position, position, art.spec)
        prob = float(art.classifier(x).softmax(dim=-1)[..., 1])
    return prob >= art.tau


def median_ms(fn: Callable[[int], object], calls: int, warmup: int) -> dict:
    """Median and 90th percentile of `calls` timed calls, after `warmup` untimed ones."""
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"median_ms": statistics.median(times), "p90_ms": times[int(0.9 * (calls - 1))]}


def check_same_features(rows: torch.Tensor) -> float:
    """Largest difference between the two routes' features on the benchmark's rows."""
    return float((distribution_features(rows) - previous_features(rows)).abs().max())


def measure(art: DiscoArtifact, rows: torch.Tensor, threads: int, calls: int) -> dict:
    """Every timing for one thread count. `after` takes the rows in turn (a row that is not
    in the core's cache), `after_same_row` repeats one row (a row the draft's output head has
    just written), `after_bf16` gives bf16 rows, as a bf16 draft returns them."""
    torch.set_num_threads(threads)
    ctrl = DiscoLength(art)
    ctrl.begin()
    n = len(rows)
    half = rows.to(torch.bfloat16)
    warmup = max(20, calls // 10)
    with torch.inference_mode():
        x = assemble(distribution_features(rows[0]), 0, 0, art.spec)
        parts = {
            "features": median_ms(lambda i: distribution_features(rows[i % n]), calls, warmup),
            "classifier": median_ms(
                lambda i: art.classifier.accept_probability(x), calls, warmup
            ),
        }
    return {
        "threads": threads,
        "before": median_ms(lambda i: previous_decision(art, rows[i % n], i % 8), calls, warmup),
        "after": median_ms(lambda i: ctrl.keep_drafting(i % 8, rows[i % n]), calls, warmup),
        "after_same_row": median_ms(lambda i: ctrl.keep_drafting(i % 8, rows[0]), calls, warmup),
        "after_bf16": median_ms(lambda i: ctrl.keep_drafting(i % 8, half[i % n]), calls, warmup),
        "after_parts": parts,
    }


def write_markdown(result: dict, path: Path) -> None:
    """A short table of the medians, before and after, per thread count."""
    lines = [
        "# DISCO decision cost",
        "",
        f"One decision = features of one {result['vocab']:,}-token logits row + the classifier "
        f"({result['classifier']['features']} features, hidden {result['classifier']['hidden']}, "
        f"weights of `{result['artifact']}`); median (p90) over {result['calls']} calls on "
        f"random logits (std {result['logit_std']}), torch {result['torch']}, "
        f"{result['cpu']}, {result['cores']} cores. Before: log-softmax over the row, top-k "
        "over all of it, the classifier called as a module. After: `DiscoLength.keep_drafting`; "
        f"the rows are taken in turn ({ROWS} rows) unless the column says otherwise.",
        "",
        "| threads | before | after | after, one row repeated | after, bf16 rows "
        "| features | classifier |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["runs"]:
        cells = [r[k] for k in ("before", "after", "after_same_row", "after_bf16")]
        cells += [r["after_parts"]["features"], r["after_parts"]["classifier"]]
        lines.append(
            f"| {r['threads']} | "
            + " | ".join(f"{c['median_ms']:.3f} ms ({c['p90_ms']:.3f})" for c in cells)
            + " |"
        )
    lines += [
        "",
        f"Largest feature difference between the two routes on these rows: "
        f"{result['max_feature_diff']:.2e}.",
        "",
        result["note"],
        "",
    ]
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", default="experiments/results/disco/humaneval.pt")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--logit-std", type=float, default=3.0)
    ap.add_argument("--note", default="", help="a line for the report (machine load, ...)")
    ap.add_argument("--out", default="experiments/results/disco")
    args = ap.parse_args()
    art = DiscoArtifact.load(args.artifact)
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(ROWS, VOCAB, generator=g) * args.logit_std
    runs = [measure(art, rows, int(t), args.calls) for t in args.threads.split(",")]
    result = {
        "vocab": VOCAB,
        "artifact": args.artifact,
        "classifier": {"features": art.spec.size, "hidden": art.classifier.hidden},
        "calls": args.calls,
        "logit_std": args.logit_std,
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "max_feature_diff": check_same_features(rows),
        "note": args.note,
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decision_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, out / "decision_cost.md")
    for r in runs:
        print(
            f"{r['threads']} thread(s): before {r['before']['median_ms']:.3f} ms, "
            f"after {r['after']['median_ms']:.3f} ms"
        )


if __name__ == "__main__":
    main()
