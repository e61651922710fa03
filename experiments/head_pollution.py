"""What a draft-head step costs the target call after it: the target's 1- and 2-token calls
timed back to back (as plain decoding runs them) and each right after one head step (as
`auto` runs them after a peek), on the default runtime, interleaved in rounds.

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/head_pollution.py \
        --out experiments/results/<dir>/head-pollution.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--weights", default="int8", help="the head's run-time format (ggml: its "
                   "layer in ik_llama.cpp, in this process)")
    p.add_argument("--out", default="")
    p.add_argument("--default-spin", action="store_true",
                   help="libgomp's own spin count in this process (torch imported before "
                        "adaspec, as a program that imports torch first has it)")
    args = p.parse_args()
    if args.default_spin:
        import torch
    import adaspec  # noqa: F401  (sets the spin count while torch loads, core/openmp.py)

    # isort: split
    import torch

    from adaspec.backends.load import load_backends
    from adaspec.cost.measure import context_ids
    from adaspec.draft.head_artifact import builtin_for
    from adaspec.draft.head_ggml import load_drafter
    from adaspec.lab.bench.machine import describe_machine

    target, _, _, _ = load_backends(draft=None)
    path = builtin_for(target.name)
    assert path is not None, "no head ships for the target"
    head = load_drafter(Path(path), target, args.weights)
    step = head.probe_step(args.context)
    ids = context_ids(args.context, target.vocab_size)
    target.prefill(torch.tensor(ids))
    times: dict[str, list[float]] = {}
    for r in range(args.rounds + 2):
        for rows in (1, 2):
            for after in ("target", "head"):
                if after == "target":  # the call before it: the target's, as in `ar`
                    target.forward(torch.tensor(ids[-1:]))
                    target.truncate(args.context)
                else:
                    step()
                t0 = time.perf_counter()
                target.forward(torch.tensor(ids[-rows:]))
                ms = 1000 * (time.perf_counter() - t0)
                target.truncate(args.context)
                if r >= 2:
                    times.setdefault(f"{rows} rows after {after}", []).append(ms)
    t0 = time.perf_counter()
    for _ in range(20):
        step()
    head_ms = 1000 * (time.perf_counter() - t0) / 20
    out = {"machine": describe_machine(), "runtime": target.kind, "context": args.context,
           "weights": args.weights,
           "spin": "libgomp's default" if args.default_spin else "adaspec's (core/openmp.py)",
           "rounds": args.rounds, "head_step_ms_back_to_back": round(head_ms, 2),
           "median_ms": {k: round(statistics.median(v), 2) for k, v in times.items()},
           "mean_ms": {k: round(statistics.fmean(v), 2) for k, v in times.items()}}
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    target.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
