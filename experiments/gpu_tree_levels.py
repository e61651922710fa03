"""What one level of a draft tree costs on the static runtime (issue 34): the level's mask
hides the branches fed before it, which used to send it to the exact-shape pass (no graph)
and now runs as a fixed pass (a CUDA graph on a GPU). Random-init weights of the draft's
real shape (the 0.5B), bf16, a 512-token cache; median ms of 20 after a warm-up.

    PYTHONPATH=src python experiments/gpu_tree_levels.py --out $OUT     # on a GPU
    PYTHONPATH=src python experiments/gpu_tree_levels.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from gpu_costs import SHAPES, TINY, model_of, timed


def level_ms(backend, device: str, context: int, width: int, fed: int, reps: int) -> float:
    """ms of feeding `width` nodes after `fed` earlier tree nodes, each new node seeing the
    context and one earlier node (its parent), not the others."""
    backend.reset()
    backend.prefill(torch.randint(0, 1000, (context,)))
    backend.forward(torch.randint(0, 1000, (fed,)), torch.full((fed,), context),
                    torch.eye(fed, dtype=torch.bool))
    start = context + fed
    parents = torch.zeros(width, fed, dtype=torch.bool)
    parents[torch.arange(width), torch.arange(width) % fed] = True
    mask = torch.cat([torch.ones(width, context, dtype=torch.bool), parents,
                      torch.eye(width, dtype=torch.bool)], dim=1)
    tokens, positions = torch.randint(0, 1000, (width,)), torch.full((width,), context + 1)

    def one() -> None:
        backend.forward(tokens, positions, mask)
        backend.truncate(start)

    return timed(one, device, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from adaspec.backends.torch.static import static_backend

    name, shape = (("tiny", TINY["tiny"]) if args.tiny
                   else ("qwen2.5-coder-0.5b", SHAPES["qwen2.5-coder-0.5b"]))
    model = model_of(shape, 1000 if args.tiny else 151_936, args.device, torch.bfloat16)
    graphs = "cuda" if args.device == "cuda" else "eager"
    record: dict = {"model": name, "device": args.device, "context": args.context, "levels": []}
    fixed = static_backend(model, name, args.device, args.context + 256, graphs=graphs)
    exact = static_backend(model, name, args.device, args.context + 256, graphs="off")
    for width, fed in ((8, 4), (16, 12)):  # a 4x2x2 tree's second and third levels
        row = {"width": width, "fed_before": fed,
               "fixed_ms": round(level_ms(fixed, args.device, args.context, width, fed,
                                          args.reps), 3),
               "exact_ms": round(level_ms(exact, args.device, args.context, width, fed,
                                          args.reps), 3)}
        record["levels"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tree_levels.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
