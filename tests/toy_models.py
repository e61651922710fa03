"""Context-sensitive toy models: the next token is a hash of the last few tokens and of the
whole context, so a stale or misplaced KV-cache entry changes the output.

conftest's tiny random models barely read their context (the greedy next token mostly
follows the last token alone), so a cache that keeps rejected draft tokens, or misses a
rollback, often still gives the right tokens and the bug survives. This Qwen2 has its
weights set by hand, no training:

- the token embedding lives in the first `SLOT` dims of the residual stream;
- attention heads with constant queries and keys (zero weights, set biases) whose RoPE
  scores peak at one relative offset: head h copies the embedding of the token `h + 1`
  places back into its own slot of the residual stream, and one head with zero query
  averages every earlier token (a bag of the whole context);
- a random MLP whose output swamps the residual stream turns the concatenation (this
  token, the previous OFFSETS tokens, the context's mean) into a pseudo-random vector,
  read by a sharpened random output head.

So the greedy next token is a pseudo-random function of the last OFFSETS + 1 tokens and of
every token before them (through the mean), and of the positions the cache holds them at
(RoPE): a wrong or stale entry among the last tokens changes it almost surely.
"""

from __future__ import annotations

import math

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

SLOT = 16  # residual dims per slot: the token's embedding, one per copy head, the mean
OFFSETS = 3  # heads copying the token 1..OFFSETS places back
HEADS = OFFSETS + 2  # + the bag-of-context head + one unused head (the embedding's slot)
HIDDEN = SLOT * HEADS


def toy_model(seed: int = 0, vocab: int = 64, context: int = 256, sharpen: float = 30.0,
              peak: float = 80.0, bag_gain: float = 4.0, mlp_gain: float = 20.0,
              mix: float = 4.0, layers: int = 3, act: str = "tanh"):
    """A Qwen2 (hidden HIDDEN, HEADS heads of SLOT dims) whose greedy next token is a
    pseudo-random function of its context; `seed` picks the function (the draft model of a
    test is another seed of the same construction)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=context,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        hidden_act=act,
    )
    model = Qwen2ForCausalLM(cfg).float().eval()
    theta = 10000.0 ** (-torch.arange(SLOT // 2, dtype=torch.float64) * 2 / SLOT)
    layer = model.model.layers[0]
    attn = layer.self_attn
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, model.model.norm):
            norm.weight.fill_(1.0)
        emb = torch.randn(vocab, SLOT, generator=gen)
        emb = emb / emb.norm(dim=-1, keepdim=True) * math.sqrt(HIDDEN)  # = its own RMS norm
        model.model.embed_tokens.weight[:, :SLOT] = emb
        # Scores q.k / sqrt(SLOT) = peak * mean_i cos((delta - d) theta_i): highest at
        # delta = d (RoPE rotates the query by its position and the key by its own).
        amp = math.sqrt(peak * math.sqrt(SLOT) / (SLOT // 2))
        for h in range(HEADS):
            rows = slice(h * SLOT, (h + 1) * SLOT)
            if h < OFFSETS:  # copy the token h + 1 places back
                d = h + 1
                half = SLOT // 2
                attn.q_proj.bias[rows][:half] = amp
                attn.k_proj.bias[rows][:half] = amp * torch.cos(d * theta).float()
                attn.k_proj.bias[rows][half:] = amp * torch.sin(d * theta).float()
                gain = 1.0
            elif h == OFFSETS:  # zero query and key: the mean of the whole context
                gain = bag_gain
            else:
                continue
            attn.v_proj.weight[rows, :SLOT] = torch.eye(SLOT)
            # head h writes slot h + 1 (slot 0 is the token's own embedding)
            attn.o_proj.weight[(h + 1) * SLOT : (h + 2) * SLOT, rows] = gain * torch.eye(SLOT)
        for block in model.model.layers:  # later layers: attention off, a random MLP each
            mlp = block.mlp
            block.input_layernorm.weight.fill_(1.0)
            block.post_attention_layernorm.weight.fill_(1.0)
            inner = mlp.gate_proj.weight.shape[0]
            for w in (mlp.gate_proj.weight, mlp.up_proj.weight):
                w.copy_(torch.randn(inner, HIDDEN, generator=gen) * mix / math.sqrt(HIDDEN))
            mlp.down_proj.weight.copy_(
                torch.randn(HIDDEN, inner, generator=gen) * mlp_gain / math.sqrt(inner)
            )
        model.lm_head.weight.copy_(torch.randn(vocab, HIDDEN, generator=gen) * sharpen
                                   / math.sqrt(HIDDEN))
    return model


def greedy_next(model, tokens: list[int]) -> int:
    """The greedy next token after `tokens`, recomputed without a cache."""
    with torch.no_grad():
        return int(model(torch.tensor([tokens])).logits[0, -1].argmax())


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt`, each recomputed from scratch (no cache)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(greedy_next(model, ids))
    return ids[len(prompt):]
