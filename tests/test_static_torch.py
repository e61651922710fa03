"""The static-cache torch runtime (`--weights static`, backends/torch/static.py) on tiny
models: Hugging Face's greedy `generate` on the same weights, the transformers runtime's
logits for prompts, chains and trees with rollbacks after every kind of step, loading
through the runtime registry, and clear errors for what it does not run. (The engine's
exactness tests and the backend tests run on it too: tests/conftest.py `runtime_target`.)"""

from __future__ import annotations

import pytest
import torch

from adaspec.backends.torch.backend import TorchBackend
from adaspec.backends.torch.static import DecoderConfig, static_backend
from adaspec.errors import InputError
from adaspec.methods.build import build_generator

from .conftest import tiny_model


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.float(), b.float(), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("graphs", ["off", "eager"])  # exact shapes; a GPU's fixed ones
@pytest.mark.parametrize("tie", [False, True])
def test_greedy_is_hugging_face_generate(tie, graphs):
    model = tiny_model(seed=3, tie=tie, random_norms=True)
    prompt = [5, 9, 2, 33, 17, 8]
    want = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    engine = build_generator("ar", static_backend(model, "tiny", graphs=graphs), None, None,
                          eos_token_ids=[])
    assert engine.generate(prompt, 24).token_ids == want
    spec = build_generator("draft:tree=2x2x1", static_backend(model, "tiny", graphs=graphs), None,
                        TorchBackend(tiny_model(seed=4, layers=1), "draft"), eos_token_ids=[])
    assert spec.generate(prompt, 24).token_ids == want


def test_projections_are_fused_and_their_names_still_reach_them():
    model = tiny_model(seed=6, random_norms=True)
    backend = static_backend(model, "fused")
    layer = backend.model.model.layers[0]
    weight, bias = layer.self_attn.qkv
    q = layer.self_attn.q_proj.weight
    assert weight.shape[0] == q.shape[0] + 2 * layer.self_attn.k_proj.weight.shape[0]
    assert layer.mlp.gate_up is not None and bias is not None
    assert q.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    prompt = torch.tensor([3, 14, 15, 9, 26])
    before = backend.prefill(prompt).logits
    close(before, TorchBackend(model, "ref").prefill(prompt).logits)
    with torch.no_grad():  # an adapter written by name (online distillation) reaches the
        backend.model.get_parameter("model.layers.0.mlp.up_proj.weight").mul_(3.0)
        layer.self_attn.v_proj.bias.add_(1.0)  # fused products
    backend.reset()
    assert (backend.prefill(prompt).logits - before).abs().max() > 1e-2


def test_logits_match_the_transformers_runtime_through_rollbacks():
    model = tiny_model(seed=5, random_norms=True)
    ref, new = TorchBackend(model, "ref"), static_backend(model, "new")
    prompt = torch.tensor([3, 14, 15, 9, 26, 5, 35])
    close(new.prefill(prompt).logits, ref.prefill(prompt).logits)
    chain = torch.tensor([8, 9, 7])
    close(new.forward(chain).logits, ref.forward(chain).logits)
    for b in (new, ref):
        b.truncate(8)  # a chain's rollback
    # a tree: root 1 with children 2 and 3, child 4 under 2
    tokens = torch.tensor([11, 12, 13, 14])
    parents = [-1, 0, 0, 1]
    mask = torch.zeros(4, 4, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    positions = torch.tensor([8, 9, 9, 10])
    close(new.forward(tokens, positions, mask).logits, ref.forward(tokens, positions, mask)
          .logits)
    keep = torch.tensor([*range(8), 8, 9, 11])  # the accepted path: root, child 2, child 4
    for b in (new, ref):
        b.keep(keep)
    assert new.cache_len == ref.cache_len == 11
    nxt = torch.tensor([21, 22])
    close(new.forward(nxt).logits, ref.forward(nxt).logits)
    hidden_new = new.prefill(prompt, hidden_layer=2).hidden
    hidden_ref = ref.prefill(prompt, hidden_layer=2).hidden
    assert hidden_new is not None and hidden_ref is not None
    close(hidden_new, hidden_ref)


def test_prefill_keeps_a_shared_prefix():
    model = tiny_model(seed=6)
    new = static_backend(model, "new")
    ref = TorchBackend(model, "ref")
    first = torch.tensor([4, 5, 6, 7, 8])
    new.prefill(first)
    second = torch.tensor([4, 5, 6, 9, 10, 11])
    out = new.prefill(second, reuse=3)
    close(out.logits, ref.prefill(second).logits)
    assert new.cache_len == len(second)


def test_loads_through_the_registry(model_dirs):
    from adaspec.backends.load import load_backend

    target, _ = model_dirs
    static, tokenizer, eos = load_backend(target, "float32", "static", device="cpu")
    plain, _, _ = load_backend(target, "float32", "none", device="cpu")
    assert static.kind == "torch-static" and eos
    prompt = tokenizer("def add(a, b):")["input_ids"]
    want = build_generator("ar", plain, tokenizer, None, eos_token_ids=eos).generate(prompt, 16)
    got = build_generator("ar", static, tokenizer, None, eos_token_ids=eos).generate(prompt, 16)
    assert got.token_ids == want.token_ids


def test_clear_errors():
    model = tiny_model(seed=7, context=16)
    backend = static_backend(model, "tiny")
    assert backend.max_context == 16
    with pytest.raises(InputError, match="context too long for the static runtime"):
        backend.prefill(torch.arange(1, 20))
    with pytest.raises(InputError, match="empty prompt"):
        backend.prefill(torch.tensor([], dtype=torch.long))
    cfg = model.config
    cfg.model_type = "gpt2"
    with pytest.raises(InputError, match="runs qwen2 and llama models, not 'gpt2'"):
        DecoderConfig.from_hf(cfg)


def test_a_cost_profile_measures_on_it(tokenizer):
    """`adaspec profile` on the static runtime (what `--device cuda` runs): its curves, its
    floor's bandwidth measured in its device's memory, its own profile key."""
    from adaspec.cost.cache import profile_key
    from adaspec.cost.measure import measure_profile
    from adaspec.engine.overhead import loop_overhead_ms

    target = static_backend(tiny_model(seed=8, vocab=len(tokenizer)), "tiny-static")
    profile = measure_profile(target, None, tokenizer, sizes=[1, 2, 4], contexts=[16, 48],
                              repeats=1, progress=False, loop_overhead=loop_overhead_ms)
    assert profile.target(1) > 0 and profile.bandwidth_gbs > 0
    assert profile_key(target, None)["target"]["kind"] == "torch-static"
    assert "device" not in profile_key(target, None)  # a CPU profile's key as before


def tree_mask_of(parents: list[int]) -> torch.Tensor:
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    return mask


def test_fixed_shapes_score_what_exact_shapes_score():
    """The padded, fixed-shape passes a GPU captures as CUDA graphs (run eagerly here) give
    the exact-shape logits: chains of every padding, a tree, a tree path kept, a rollback, a
    pass longer than the largest fixed size (which runs at its own shape)."""
    model = tiny_model(seed=11, random_norms=True, context=256)
    exact, fixed = static_backend(model, "exact", graphs="off"), static_backend(
        model, "fixed", graphs="eager")
    prompt = torch.tensor([3, 14, 15, 9, 26, 5, 35, 8])
    close(fixed.prefill(prompt).logits, exact.prefill(prompt).logits)
    for n in (1, 3, 5, 8, 13, 64, 65):
        chain = torch.randint(1, 60, (n,), generator=torch.Generator().manual_seed(n))
        close(fixed.forward(chain).logits, exact.forward(chain).logits)
    # 65 tokens: the exact-shape pass
    assert {size for size, _, _ in fixed._fixed} == {1, 4, 8, 16, 64}
    for b in (exact, fixed):
        b.truncate(20)  # a chain's rollback
    tokens, parents = torch.tensor([11, 12, 13, 14, 15]), [-1, 0, 0, 1, 2]
    mask, positions = tree_mask_of(parents), torch.tensor([20, 21, 21, 22, 22])
    close(fixed.forward(tokens, positions, mask).logits,
          exact.forward(tokens, positions, mask).logits)
    keep = torch.tensor([*range(20), 20, 22, 24])  # root, child 2, its child
    for b in (exact, fixed):
        b.keep(keep)
    nxt = torch.tensor([21, 22, 23])
    close(fixed.forward(nxt).logits, exact.forward(nxt).logits)
    assert fixed.cache_len == exact.cache_len == 26


def test_a_draft_trees_levels_run_as_fixed_passes():
    """A draft tree feeds level by level, each level's mask as wide as the cache: the new
    nodes see the context and their own ancestors, not the other branches fed before them.
    Those passes run at the fixed sizes too (a GPU's graphs; seen eager-only on the H200, at
    10x the cost), and score what exact shapes score."""
    model = tiny_model(seed=15, random_norms=True, context=256)
    exact, fixed = static_backend(model, "exact", graphs="off"), static_backend(
        model, "fixed", graphs="eager")
    prompt = torch.tensor([3, 14, 15, 9, 26, 5, 35, 8])
    for b in (exact, fixed):
        b.prefill(prompt)
    base = len(prompt)
    # level 1: two children of the root; level 2: two children each (4 nodes)
    levels = [([21, 22], [[1, 0], [0, 1]]),
              ([31, 32, 33, 34], None)]
    full1 = torch.cat([torch.ones(2, base, dtype=torch.bool),
                       torch.tensor(levels[0][1], dtype=torch.bool)], dim=1)
    pos1 = torch.full((2,), base)
    close(fixed.forward(torch.tensor(levels[0][0]), pos1, full1).logits,
          exact.forward(torch.tensor(levels[0][0]), pos1, full1).logits)
    ancestors = torch.tensor([[1, 0], [1, 0], [0, 1], [0, 1]], dtype=torch.bool)
    full2 = torch.cat([torch.ones(4, base, dtype=torch.bool), ancestors,
                       torch.eye(4, dtype=torch.bool)], dim=1)
    pos2 = torch.full((4,), base + 1)
    exact_runs = []
    real = fixed._exact_run
    fixed._exact_run = lambda *a, **k: exact_runs.append(1) or real(*a, **k)
    level2 = fixed.forward(torch.tensor(levels[1][0]), pos2, full2).logits
    close(level2, exact.forward(torch.tensor(levels[1][0]), pos2, full2).logits)
    # the fixed pass of 4 (no features recorded), not the exact shape
    assert not exact_runs and (4, 256, False) in fixed._fixed
    # a sibling's key differs from the ancestor's: seeing it would change the logits
    wrong = full2.clone()
    wrong[:, base:base + 2] = True
    for b in (exact, fixed):
        b.truncate(base + 2)
    assert not torch.allclose(fixed.forward(torch.tensor(levels[1][0]), pos2, wrong).logits,
                              level2, atol=1e-3)


def test_fixed_padding_never_writes_a_cache_slot():
    """A fixed pass of 3 tokens runs as 4: the padding's keys go to scratch slots past the
    cache, so the slot after the real tokens stays as it was."""
    backend = static_backend(tiny_model(seed=12), "fixed", graphs="eager")
    backend.prefill(torch.tensor([4, 5, 6, 7]))
    backend.forward(torch.tensor([8, 9, 10]))
    keys, values = backend._cache[0]
    assert bool(keys[:, :, :7].abs().sum(-1).gt(0).all())  # the real tokens were written
    assert not bool(keys[:, :, 7:backend.max_context].any())
    assert not bool(values[:, :, 7:backend.max_context].any())
    assert bool(keys[:, :, backend._scratch].any())  # the padding's went to scratch


def test_graph_settings_are_checked():
    model = tiny_model(seed=13)
    with pytest.raises(InputError, match="graphs must be one of auto, cuda, eager, off"):
        static_backend(model, "tiny", graphs="always")
    with pytest.raises(InputError, match="CUDA graphs need the model on a CUDA GPU"):
        static_backend(model, "tiny", graphs="cuda")
    assert static_backend(model, "tiny").graphs == "off"  # auto, on the CPU


def test_compiled_fixed_passes_score_what_exact_shapes_score(capsys):
    """torch.compile over the fixed pass (what a GPU then captures as graphs): the same
    logits, the compiler really ran; a compiler that fails leaves the eager pass, said."""
    from torch._dynamo.utils import counters

    model = tiny_model(seed=14, random_norms=True)
    exact = static_backend(model, "exact", graphs="off")
    compiled = static_backend(model, "compiled", graphs="eager", compile=True)
    prompt = torch.tensor([3, 14, 15, 9, 26, 5, 35])
    for b in (exact, compiled):
        b.prefill(prompt)
    before = counters["stats"]["unique_graphs"]
    # one pass size, compiled once and run again (other sizes and spans compile in
    # test_fixed_passes_attend_over_a_span_covering_the_cache_not_every_slot: each cold
    # compile costs a worker 10-20 s on 2 vCPUs)
    for toks in ([8], [9]):
        close(compiled.forward(torch.tensor(toks)).logits, exact.forward(torch.tensor(toks))
              .logits)
    assert counters["stats"]["unique_graphs"] > before and compiled.compiled
    with pytest.raises(InputError, match="compile applies to the fixed-shape passes"):
        static_backend(model, "x", graphs="off", compile=True)

    def broken(f):
        raise RuntimeError("no compiler here")

    failing = static_backend(model, "failing", graphs="eager", compile=True)
    failing._pass = broken
    failing.prefill(prompt)
    exact.truncate(len(prompt))
    close(failing.forward(torch.tensor([8])).logits, exact.forward(torch.tensor([8])).logits)
    assert not failing.compiled
    assert "torch.compile failed for the static runtime (RuntimeError: no compiler here)" in (
        capsys.readouterr().err)


def test_compiling_leaves_room_for_every_pass_size_of_two_models():
    """Each pass size of each model is one compiled graph of the same code: a target and a
    draft past dynamo's default limit of 8 (seen on the H200: the draft fell back to eager)."""
    torch._dynamo.config.recompile_limit = 8
    static_backend(tiny_model(seed=3), "compiled", graphs="eager", compile=True)
    assert torch._dynamo.config.recompile_limit >= 2 * 7  # two models x 1..64 in powers of 2


def test_a_layers_mask_is_made_where_its_inputs_are():
    """A chunk after cached keys builds its causal mask on the inputs' device (the meta
    device stands in for a GPU: a mask left on the CPU fails there, as S2D's did on CUDA)."""
    from adaspec.backends.torch.decoder import Attention, rope

    cfg = DecoderConfig.from_hf(tiny_model(seed=3).config)
    attention = Attention(cfg).to("meta")  # called outside `torch.device("meta")`, which
    # would put a mask made without a device there too
    x = torch.randn(1, 3, cfg.hidden_size, device="meta")
    past = (torch.randn(1, cfg.num_kv_heads, 5, cfg.head_dim, device="meta"),) * 2
    cos, sin = rope(torch.arange(5, 8, device="meta"), cfg.head_dim, cfg.rope_theta, x.dtype)
    out, (keys, _) = attention(x, cos, sin, past)
    assert out.shape == (1, 3, cfg.hidden_size) and keys.shape[-2] == 8


def test_fixed_passes_attend_over_a_span_covering_the_cache_not_every_slot():
    """A fixed pass reads the cache's first `span` slots (a power of two covering the pass),
    not every slot of a long cache, and scores what exact shapes score on either side of a
    span's edge; compiled, the span is a dynamic dimension, so a size compiles once for
    every span, and a pass where nothing came before (only padding rows) yields no NaN."""
    from torch._dynamo.utils import counters

    from adaspec.backends.torch.static import MIN_SPAN

    model = tiny_model(seed=21, random_norms=True, context=2048)
    exact = static_backend(model, "exact", graphs="off")
    fixed = static_backend(model, "fixed", graphs="eager")
    compiled = static_backend(model, "compiled", graphs="eager", compile=True)
    total = fixed._slot_ids.numel()
    gen = torch.Generator().manual_seed(21)
    prompt = torch.randint(1, 60, (MIN_SPAN - 6,), generator=gen)
    for b in (exact, fixed, compiled):
        b.prefill(prompt)
    before = counters["stats"]["unique_graphs"]
    for n in (1, 4, 4, 1, 8, 4, 240, 1, 4, 4):  # 250 -> 512 -> 1024; 240: an exact shape
        chain = torch.randint(1, 60, (n,), generator=gen)
        want = exact.forward(chain).logits
        close(fixed.forward(chain).logits, want)
        close(compiled.forward(chain).logits, want)
    spans = {span for _, span, _ in fixed._fixed}
    assert {256, 512, 1024} <= spans and max(spans) < total
    assert compiled.compiled and {s for _, s, _ in compiled._fixed} == spans
    sizes = {size for size, _, _ in compiled._fixed}
    # a size compiles at most twice (its first span static, then the span dynamic), not
    # once per span
    assert counters["stats"]["unique_graphs"] - before <= 2 * len(sizes)
    # padding rows of a pass that sees no earlier slot still read something: no NaN
    empty = static_backend(model, "empty", graphs="eager")
    assert torch.isfinite(empty.forward(torch.tensor([5, 6, 7])).logits).all()
    assert torch.isfinite(empty.forward(torch.tensor([8])).logits).all()
