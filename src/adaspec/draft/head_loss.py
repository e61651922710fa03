"""The draft head's training loss, shared by training on recorded features
(`lab/head/train.py`) and learning on served requests (`online/head.py`).

An example is a row: `tokens` [T], the target's final-normed states `final` [T, H] (or
`layers` [T, 3, H]), the target's next-token distribution at each position as `top_ids` /
`top_probs` [T, k], and `prompt_len`. Each example is trained whole (B = 1). Input index i
is the pair (feature at i, embedding of token i + 1); its label is the target's distribution
at i + 1 (of token i + 2) over the kept tokens, and its regression target the target's
feature at i + 1 (EAGLE's feature loss). With `depth` D > 1 the loss also covers D - 1
unrolled draft steps (EAGLE-3's training-time test): at depth d the input feature is the
head's own output of depth d - 1 at index i - 1, and the query attends to the depth-1 keys
up to index i - d + 1 and to one key of each deeper step, as at inference after d - 1
drafted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from adaspec.draft.head_model import DraftHead, TokenHead


class LossSettings(Protocol):
    features: str  # "final" (EAGLE) or "layers" (EAGLE-3's low/mid/high)
    feature_weight: float  # smooth-L1 on the feature beside the token loss


@dataclass
class Frozen:
    """The target's pieces the head reads: token embeddings [V, H] and the kept tokens'
    output rows."""

    embed: torch.Tensor
    token_head: TokenHead
    index: torch.Tensor  # [V] full id -> kept index, -1 outside the kept set


def kept_index(token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[vocab] full id -> its index among the kept tokens, -1 outside them."""
    index = torch.full((vocab,), -1, dtype=torch.long)
    index[token_ids] = torch.arange(len(token_ids))
    return index


def _inputs(row: dict, cfg: LossSettings) -> torch.Tensor:
    if cfg.features == "final":
        return row["final"].float()
    return row["layers"].float().flatten(1)  # [T, 3H]


def _masks(n: int, depth: int) -> list[torch.Tensor]:
    """Attention masks of the unrolled steps: for depth d (1-based) over n indices, a bool
    [n, d * n] mask over (depth-1 keys, ..., depth-d keys): query i sees the depth-1 keys up
    to i - d + 1 and, of each depth p in 2..d, the one key at i - (d - p)."""
    masks = []
    for d in range(1, depth + 1):
        blocks = [torch.ones(n, n, dtype=torch.bool).tril(-(d - 1))]
        for p in range(2, d + 1):
            lag = d - p
            block = torch.zeros(n, n, dtype=torch.bool)
            if lag < n:
                block |= torch.diag(torch.ones(n - lag, dtype=torch.bool), -lag)
            blocks.append(block)
        masks.append(torch.cat(blocks, 1))
    return masks


def unrolled(head: DraftHead, frozen: Frozen, row: dict, cfg: LossSettings, depth: int,
             noise: float = 0.0, visible_from: int = 0) -> list[torch.Tensor]:
    """The head's outputs [n, H] at each depth 1..depth over one example (n = T - 1).
    visible_from: indices from there on see no earlier one (a runtime that gave the head no
    features of the prompt before it)."""
    feats = _inputs(row, cfg)[:-1]  # [n, F*H] features at i
    tokens = row["tokens"].long()
    embeds = frozen.embed[tokens[1:]].float()[None]  # [1, n, H]: token i + 1
    n = embeds.shape[1]
    positions = torch.arange(n)[None]
    if noise:
        feats = feats + (torch.rand_like(feats) * 2 - 1) * noise
    masks = _masks(n, depth)
    if visible_from > 0:
        for m in masks:
            m[visible_from:, :visible_from] = False
    outs: list[torch.Tensor] = []
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    x = feats[None]
    for d in range(depth):
        if d:  # the head's own output at i - 1 stands in for the feature at i
            prev = outs[-1][0]
            own = torch.cat([prev[:1] * 0, prev[:-1]], 0)
            if cfg.features != "final":  # fused features: the own output fills each slot
                own = own.repeat(1, head.cfg.features)
            x = own[None]
        past = (torch.cat(keys, 2), torch.cat(values, 2)) if keys else None
        h, (k, v) = head(x, embeds, positions, past, masks[d])
        new = k.shape[2] - (past[0].shape[2] if past is not None else 0)
        keys.append(k[:, :, -new:])
        values.append(v[:, :, -new:])
        outs.append(h)
    return [o[0] for o in outs]


def head_losses(frozen: Frozen, row: dict, outs: list[torch.Tensor], cfg: LossSettings
            ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    top_ids = row["top_ids"].long()[1:]  # [n, k]: the target's distribution at i + 1
    top_p = row["top_probs"].float()[1:]
    target_feat = row["final"].float()[1:]
    kept = frozen.index[top_ids]  # [n, k]
    weight = torch.where(kept >= 0, top_p, torch.zeros_like(top_p))
    greedy = kept[:, 0]
    loss = torch.zeros(())
    hits: list[tuple[int, int]] = []
    for d, h in enumerate(outs):
        valid = torch.arange(h.shape[0]) >= d  # depth d needs d earlier indices
        logp = torch.log_softmax(frozen.token_head(h), -1)
        ce = -(weight * logp.gather(1, kept.clamp(min=0))).sum(1)
        feat = nn.functional.smooth_l1_loss(h, target_feat, reduction="none").mean(1)
        term = ce + cfg.feature_weight * feat
        loss = loss + term[valid].mean() / len(outs)
        pred = logp.argmax(1)
        ok = (pred == greedy) & (greedy >= 0) & valid
        hits.append((int(ok.sum()), int(valid.sum())))
    return loss, hits




def row_agreement(head: DraftHead, frozen: Frozen, row: dict, cfg: LossSettings, depth: int,
                  visible_from: int = 0) -> list[tuple[int, int]]:
    """Per depth, (answer positions where the head's top token is the target's top token,
    answer positions): greedy acceptance given the earlier drafts were right. Positions
    without a known next token (top_probs 0, the last of a served request) are left out."""
    with torch.no_grad():
        outs = unrolled(head, frozen, row, cfg, depth, visible_from=visible_from)
    labels = frozen.index[row["top_ids"].long()[1:, 0]]
    known = row["top_probs"][1:, 0] > 0
    start = max(0, int(row["prompt_len"]) - 1)  # answer positions only
    out = []
    for d, h in enumerate(outs):
        pred = frozen.token_head(h).argmax(1)
        sel = (torch.arange(h.shape[0]) >= max(d, start)) & known
        out.append((int(((pred == labels) & (labels >= 0) & sel).sum()), int(sel.sum())))
    return out
