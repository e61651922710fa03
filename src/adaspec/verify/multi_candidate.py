"""Verifying a token tree: multi-candidate speculative decoding (Yang et al., MCSD).

The walk starts at the root. At a node with children the verifier looks at the children's
tokens (the candidates, in the order they were drawn) and either follows one of them, or
emits a token of its own and stops; at a leaf it emits a bonus token. Each decision is one
call of a batched `step` over B independent nodes:

    step(candidates [B, k], q [B, V] or None, p [B, V], generator) -> (choice [B], token [B])

choice is the index of the accepted candidate or -1, token is that candidate or the emitted
token. q is the processed draft distribution the candidates were drawn from (None: the
candidates are deterministic, e.g. the top-k at temperature 0, and count as probability 1),
p the processed target distribution at the node. Every sampling step below emits a token
distributed exactly as p, so the emitted sequence is distributed as the target's.

- MCSS (Algorithm 1, candidates drawn i.i.d. from q): try the candidates in order; accept x
  with probability min(1, r(x)/q(x)) where r is the current residual (initially p); on a
  rejection set r <- norm(max(0, r - q)). If all are rejected, draw from r.
- MCSS without replacement (Algorithm 2, candidate i drawn from q without the i - 1 earlier
  ones): the same, with q_i = q renormalised without the earlier candidates in place of q.
  A rejected x had r(x) < q_i(x), so the next residual is 0 at x: excluding it from later
  proposals loses nothing.
- MCNS (naive): draw y from p; follow the first candidate equal to y, else emit y.
- Greedy: y = argmax p; follow the candidate equal to y, else emit y.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F

from adaspec.core.proposal import Proposal
from adaspec.core.sampling import may_hold, sample_rows, uniforms
from adaspec.errors import InputError
from adaspec.verify.base import Verdict, Verifier, check_token_ids


def _check_batch(candidates: torch.Tensor, p: torch.Tensor) -> None:
    if candidates.dim() != 2 or p.dim() != 2 or p.shape[0] != candidates.shape[0]:
        shapes = f"{list(candidates.shape)} and {list(p.shape)}"
        raise InputError(f"need candidates [B, k] and p [B, V], got {shapes}")


def _check_step_args(
    candidates: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Shapes, a common float dtype (>= float32) and vocabulary (zero-padded)."""
    _check_batch(candidates, p)
    if q is not None and (q.dim() != 2 or q.shape[0] != p.shape[0]):
        raise InputError(f"q must be [B, V] like p, got {list(q.shape)}")
    dtype = torch.promote_types(p.dtype, torch.float32)
    vocab = p.shape[-1]
    if q is not None:
        dtype = torch.promote_types(dtype, q.dtype)
        vocab = max(vocab, q.shape[-1])
        q = F.pad(q.to(dtype), (0, vocab - q.shape[-1]))
    p = F.pad(p.to(dtype), (0, vocab - p.shape[-1]))
    check_token_ids(candidates, vocab, "candidate")
    return candidates.to(device=p.device, dtype=torch.long), q, p


def mcss_step(
    candidates: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator | None,
    replacement: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-candidate speculative sampling at B nodes (see the module doc).

    Random draws, all from `generator`: B x k uniforms at once, then one categorical draw per
    node when some node rejected every candidate.
    """
    candidates, q, p = _check_step_args(candidates, q, p)
    batch, k = candidates.shape
    tiny = torch.finfo(p.dtype).tiny
    u = uniforms((batch, k), generator, p.dtype, p.device)
    choice = torch.full((batch,), -1, dtype=torch.long, device=p.device)
    r = p
    q_i = q
    for i in range(k):
        active = choice < 0
        if not may_hold(active):
            break
        x = candidates[:, i : i + 1]
        r_x = r.gather(1, x).squeeze(1)
        # u < r/q written without the division: q(x) = 0 with r(x) > 0 accepts.
        q_x = torch.ones_like(r_x) if q_i is None else q_i.gather(1, x).squeeze(1)
        accept = active & (u[:, i] * q_x < r_x)
        choice = torch.where(accept, i, choice)
        rejected = active & ~accept
        if may_hold(rejected):
            residual = r.scatter(1, x, 0.0) if q_i is None else (r - q_i).clamp(min=0.0)
            mass = residual.sum(1, keepdim=True)
            # All-zero residual: only rounding gets here (r == q_i); keep r.
            residual = torch.where(mass > tiny, residual / mass.clamp(min=tiny), r)
            r = torch.where(rejected.unsqueeze(1), residual, r)
        if q_i is not None and not replacement and i + 1 < k:
            q_i = q_i.scatter(1, x, 0.0)
            left = q_i.sum(1, keepdim=True)
            q_i = torch.where(left > tiny, q_i / left.clamp(min=tiny), q_i)
    return _finish(choice, candidates, r, generator)


def _finish(
    choice: torch.Tensor,
    candidates: torch.Tensor,
    dist: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token = the chosen candidate, or a draw from `dist` where nothing was chosen."""
    token = torch.zeros_like(choice)
    if candidates.shape[1] and may_hold(choice >= 0):  # a leaf has none to choose
        token = candidates.gather(1, choice.clamp(min=0).unsqueeze(1)).squeeze(1)
    missed = choice < 0
    if may_hold(missed):
        token = torch.where(missed, sample_rows(dist, generator), token)
    return choice, token


def _follow(candidates: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """choice = index of the first candidate equal to y, else -1; token = y."""
    if candidates.shape[1] == 0:
        return torch.full_like(y, -1), y
    hit = candidates == y.unsqueeze(1)
    first = hit.long().argmax(1)
    return torch.where(hit.any(1), first, -1), y


def mcns_step(
    candidates: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive multi-candidate sampling: y ~ p; follow y if it is a candidate. q is unused.
    A candidate outside the target's vocabulary (a draft with a larger one) never equals y:
    it is rejected, as the other rules reject it (p = 0 there)."""
    candidates, _, p = _check_step_args(candidates, q, p)
    return _follow(candidates, sample_rows(p, generator))


StepFn = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Generator | None],
    tuple[torch.Tensor, torch.Tensor],
]


class TreeWalkVerifier(Verifier):
    """Walks a proposal from the root with a per-node `step` (chains are trees too)."""

    @abstractmethod
    def step(
        self,
        candidates: torch.Tensor,
        q: torch.Tensor | None,
        p: torch.Tensor,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def verify(
        self,
        proposal: Proposal,
        target_probs: torch.Tensor,
        generator: torch.Generator | None,
    ) -> Verdict:
        self.check(proposal, target_probs)
        tree, draft_probs = proposal.tree, proposal.probs
        node = 0
        path: list[int] = []
        while True:
            kids = tree.children[node]
            cands = torch.tensor([[tree.tokens[c] for c in kids]], dtype=torch.long)
            q = None
            if draft_probs is not None and kids:
                if node >= draft_probs.shape[0]:
                    raise InputError(f"draft probs have no row for node {node}, which has children")
                q = draft_probs[node : node + 1].to(target_probs.device)
            choice, token = self.step(cands, q, target_probs[node : node + 1], generator)
            c, emitted = torch.cat([choice, token]).tolist()  # one read per level walked
            if c < 0:
                return Verdict(path=path, next_token=emitted)
            node = kids[c]
            path.append(node)

    def walk_regular(
        self,
        branching: tuple[int, ...],
        tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
        target_probs: torch.Tensor,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`verify` for B trees of one regular shape at once (the statistical tests
        draw 10^5 verdicts this way; with B = 1 it makes the same draws as `verify`).

        tokens: [B, n] in level order (node 0 the root); draft_probs: [B, m, V] or None;
        target_probs: [B, n, V]. Returns (path [B, D] node indices padded with -1,
        accepted [B], next_token [B]).
        """
        batch, n = tokens.shape
        depth = len(branching)
        starts = [0]
        width = 1
        for b in branching:
            starts.append(starts[-1] + width)
            width *= b
        if starts[-1] + width != n or target_probs.shape[:2] != (batch, n):
            raise InputError(f"tokens/target_probs do not fit a {branching} tree of {n} nodes")
        rows = torch.arange(batch)
        local = torch.zeros(batch, dtype=torch.long)  # position of the current node in its level
        active = torch.ones(batch, dtype=torch.bool)
        path = torch.full((batch, depth), -1, dtype=torch.long)
        accepted = torch.zeros(batch, dtype=torch.long)
        next_token = torch.zeros(batch, dtype=torch.long)
        for level in range(depth + 1):
            idx = rows[active]
            node = starts[level] + local[idx]
            if level < depth:
                b = branching[level]
                kids = starts[level + 1] + local[idx].unsqueeze(1) * b + torch.arange(b)
                cands = tokens[idx.unsqueeze(1), kids]
            else:
                cands = torch.zeros(len(idx), 0, dtype=torch.long)
            q = None if draft_probs is None or level == depth else draft_probs[idx, node]
            choice, token = self.step(cands, q, target_probs[idx, node], generator)
            stop = choice < 0
            next_token[idx[stop]] = token[stop]
            active[idx[stop]] = False
            go = idx[~stop]
            if level < depth and len(go):
                local[go] = local[go] * branching[level] + choice[~stop]
                path[go, level] = starts[level + 1] + local[go]
                accepted[go] += 1
            if not bool(active.any()):
                break
        return path, accepted, next_token


class MCSSVerifier(TreeWalkVerifier):
    """MCSS with replacement (Algorithm 1): candidates are i.i.d. draws from q."""

    name = "mcss"
    summary = "multi-candidate speculative sampling, candidates drawn i.i.d. (Algorithm 1)"
    replacement = True
    needs_matching_draws = True

    def step(self, candidates, q, p, generator):
        return mcss_step(candidates, q, p, generator, replacement=True)


class MCSSWithoutReplacementVerifier(TreeWalkVerifier):
    """MCSS without replacement (Algorithm 2): candidate i is drawn from q without the
    earlier ones."""

    name = "mcss-wor"
    summary = "multi-candidate speculative sampling, candidates drawn without replacement"
    replacement = False
    needs_matching_draws = True

    def step(self, candidates, q, p, generator):
        return mcss_step(candidates, q, p, generator, replacement=False)


class MCNSVerifier(TreeWalkVerifier):
    """Naive multi-candidate sampling (the paper's baseline). Distinct candidates serve it
    best, so the drafter draws them without replacement."""

    name = "mcns"
    summary = "naive multi-candidate: draw from p, follow the candidate equal to it"
    replacement = False

    def step(self, candidates, q, p, generator):
        return mcns_step(candidates, q, p, generator)
