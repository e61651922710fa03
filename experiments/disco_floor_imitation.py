"""Could a DISCO classifier take the floor's headroom? Train DISCO's features to imitate the
floor's lengths (`simulate.best_lengths`: keep drafting while the floor's step from that
position is longer), tune tau and SL_max on validation by simulated latency, and compare on
the Spec-Bench test prompts of both DISCO runs with the tuned Spec-Bench artifact and static
k=2 (simulated ms/token, the costs timed while tuning).

    python experiments/disco_floor_imitation.py
"""

from __future__ import annotations

import torch

from adaspec.control.disco_artifact import DiscoArtifact
from adaspec.control.disco_features import assemble
from adaspec.lab.disco.dataset import DiscoData, Sample
from adaspec.lab.disco.simulate import NEVER_STOP, Costs, best_lengths, simulate_all
from adaspec.lab.disco.train_classifier import train_classifier
from adaspec.lab.disco.tune import disco_scores

RESULTS = "experiments/results"
POSITIONS = 8  # draft positions, as SL_max's largest value


def imitation_rows(samples: list[Sample], art: DiscoArtifact, costs: Costs):
    """Features of token j drafted at position i of a step from j - i; label: the floor's
    step from there drafts past position i."""
    xs, ys = [], []
    for s in samples:
        n = len(s.hits)
        lengths = [d for d, _ in best_lengths(s.hits.tolist(), costs, POSITIONS)]
        dist = s.dist.unsqueeze(1).expand(n, POSITIONS, s.dist.shape[-1])
        x = assemble(dist, torch.arange(POSITIONS)[None, :], torch.arange(n)[:, None], art.spec)
        for j in range(1, n):
            for i in range(min(POSITIONS, j)):
                xs.append(x[j, i])
                ys.append(i + 1 < lengths[j - i])
    return torch.stack(xs), torch.tensor(ys)


def main() -> None:
    art = DiscoArtifact.load(f"{RESULTS}/disco-epyc/spec-bench.pt")
    costs = Costs(**art.tuning["costs"])
    first = DiscoData.load(f"{RESULTS}/disco-epyc/data.pt")
    held = DiscoData.load(f"{RESULTS}/disco-epyc-heldout/data.pt")
    train, val = first.split("train", "spec-bench"), first.split("val", "spec-bench")
    x_tr, y_tr = imitation_rows(train, art, costs)
    x_va, y_va = imitation_rows(val, art, costs)
    print(f"{len(y_tr)} training rows, keep-drafting rate {float(y_tr.float().mean()):.3f}")
    model = train_classifier(x_tr, y_tr, x_va, y_va, hidden=32, epochs=400, seed=0).model

    def ms(samples, tau, sl_max, classifier) -> float:
        scores = [disco_scores(s, classifier, art.spec, sl_max) for s in samples]
        hits = [s.hits.tolist() for s in samples]
        return simulate_all(hits, scores, tau, sl_max, costs).ms_per_token

    grid = [(t / 10, k) for t in range(1, 10) for k in range(1, POSITIONS + 1)]
    tau, sl_max = min(grid, key=lambda g: ms(val, g[0], g[1], model))
    print(f"imitation tuned on val: tau {tau}, SL_max {sl_max}")
    for name, test in (("first test", first.split("test", "spec-bench")),
                       ("held-out", held.split("test", "spec-bench"))):
        print(
            f"{name} ({len(test)} prompts): imitation {ms(test, tau, sl_max, model):.0f}, "
            f"DISCO {ms(test, art.tau, art.sl_max, art.classifier):.0f}, "
            f"static k=2 {ms(test, NEVER_STOP, 2, model):.0f} ms/token"
        )


if __name__ == "__main__":
    main()
