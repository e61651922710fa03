"""The ik_llama.cpp backend: the same contract as the llama.cpp backend (the tests of
test_models_llamacpp run here again on an ik_llama.cpp backend over the SmolLM2-135M GGUF),
in a child process too, and clear errors when the package is missing or of another version."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

import adaspec.backends.ik.backend as ikllama
from adaspec.backends.ik.backend import IkLlamaBackend, IkLlamaUnavailable

from .conftest import smollm_gguf
from .test_models_llamacpp import (  # noqa: F401  (collected again with this module's fixture)
    test_an_engine_reuses_the_prefix_of_its_previous_prompt,
    test_forward_truncate_and_chains_only,
    test_llamacpp_target_with_ngram_drafts_repeats_its_own_plain_decoding,
    test_prefill_keeps_a_shared_prefix_its_cache_holds,
)

pytestmark = pytest.mark.skipif(not ikllama.available(),
                                reason=f"ik-llama-cpp-python {ikllama.IK_VERSION} not installed")


@pytest.fixture(scope="module")
def smollm():
    gguf = smollm_gguf()
    return gguf, IkLlamaBackend(gguf, n_threads=1, name="smollm", n_ctx=512)


def test_another_version_is_refused_with_the_fix(monkeypatch):
    ikllama.library.cache_clear()
    monkeypatch.setattr(ikllama, "IK_VERSION", "9.9.9")
    try:
        with pytest.raises(IkLlamaUnavailable, match=r"9\.9\.9 is needed.*pip install"):
            ikllama.library()
    finally:
        monkeypatch.undo()
        ikllama.library.cache_clear()
    assert ikllama.available()


def test_in_a_child_process_it_scores_what_it_scores_in_process(smollm):
    from adaspec.backends.process_backend import ProcessBackend

    gguf, local = smollm
    child = ProcessBackend(IkLlamaBackend, str(gguf), 1, "smollm", 512)
    try:
        assert child.kind == f"{local.kind}+child"  # ik_llama, or ik_llama-native when built here
        assert child.batch_noise == local.batch_noise
        # a native build's source patches, which the cost profiles' key names
        assert child.patches == local.patches
        from adaspec.cost.cache import profile_key

        assert profile_key(child, None)["target"].get("patches") == (
            sorted(local.patches) or None)
        ids = torch.tensor([1604, 3987, 46477, 24, 94])
        a = child.prefill(ids).logits
        b = local.prefill(ids).logits
        torch.testing.assert_close(a, b)
        assert child.forward(ids[:2]).logits.shape == (2, local.vocab_size)
        child.truncate(5)
        assert child.cache_len == 5
    finally:
        child.close()


def _advised_huge_bytes() -> int:
    """Bytes of this process's mappings advised to take huge pages (`hg` in their VmFlags)."""
    total = size = 0
    with open("/proc/self/smaps") as f:
        for line in f:
            if line.startswith("Size:"):
                size = int(line.split()[1]) * 1024
            elif line.startswith("VmFlags:") and "hg" in line.split()[1:]:
                total += size
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's /proc only")
def test_a_native_build_advises_its_weights_to_take_huge_pages():
    from adaspec.backends.ik.patches import hugepages as ik_hugepages_patch

    ikllama.library()  # chooses the library (a native build when `make setup` made one)
    if ikllama._choose_build() != "native":
        pytest.skip("the wheel's library (no native build here) carries no source patches")
    before = _advised_huge_bytes()
    backend = IkLlamaBackend(smollm_gguf(), n_threads=1, name="smollm", n_ctx=512)
    try:
        assert ik_hugepages_patch.NAME in backend.patches
        # the repacked weights' buffer (about 100 MiB for SmolLM2-135M) is advised
        assert _advised_huge_bytes() - before >= 64 << 20
    finally:
        backend.close()


class CountingLib:
    """The library, noting the tokens of every llama_decode call."""

    def __init__(self, lib, fed: list[int]) -> None:
        self._lib = lib
        self._fed = fed

    def __getattr__(self, name: str):
        return getattr(self._lib, name)

    def llama_decode(self, ctx, batch):
        self._fed.append(int(batch.n_tokens))
        return self._lib.llama_decode(ctx, batch)


def test_a_target_fed_blocks_scores_a_lone_token_as_a_block_scores_it(smollm):
    """min_rows=2 pads a lone token to a block (its pad row and cache entry dropped), so a
    plain step scores bit for bit what verification scores for the same token."""
    gguf, _ = smollm
    prompt = torch.tensor([1604, 3987, 46477, 24, 94])
    more = [727, 13, 55, 300, 400, 500]

    def lone_and_blocks(backend):
        backend.prefill(prompt)
        lone = torch.cat([backend.forward(torch.tensor([t])).logits for t in more])
        assert backend.cache_len == len(prompt) + len(more)
        backend.truncate(len(prompt))
        blocks = torch.cat([backend.forward(torch.tensor(more[i : i + 3])).logits
                            for i in (0, 3)])
        return lone, blocks

    padded = IkLlamaBackend(gguf, 1, "smollm", 512, True, 2)
    fed: list[int] = []
    padded._lib = CountingLib(padded._lib, fed)
    try:
        # (`-narrow`: the 512-bit k-quant walk off, on AMD CPUs: another cost curve)
        assert padded.kind.removesuffix("-narrow").removesuffix("-fa-regions") in (
            "ik_llama-blocks2", "ik_llama-native-blocks2")
        assert padded.batch_noise == 0
        lone, blocks = lone_and_blocks(padded)
        assert torch.equal(lone, blocks)
        assert fed[1:7] == [2] * 6  # every lone token went through as a block of two
        first = padded.prefill(prompt[:1]).logits  # a one-token prompt is padded too
        assert first.shape == (1, padded.vocab_size) and padded.cache_len == 1
        assert fed[-1] == 2
        # its logits are the real token's row, not the pad's: row 0 of a real block
        padded.reset()
        assert torch.equal(first[0], padded.forward(prompt[:2]).logits[0])
    finally:
        padded.close()


def test_a_target_takes_lone_rows_only_where_the_library_scores_them_as_blocks(smollm,
                                                                               monkeypatch):
    """min_rows=None: the load-time check decides. The check's answer is what the library
    does (a lone token against the first row of a block, compared here directly); with a
    `yes` the target feeds lone tokens and rechecks nothing, with a `no` it pads to blocks."""
    gguf, _ = smollm
    prompt = torch.tensor([1604, 3987, 46477, 24, 94])
    backend = IkLlamaBackend(gguf, 1, "smollm", 512, True, None)
    try:
        assert backend.cache_len == 0  # the check leaves nothing behind
        backend.prefill(prompt)
        lone = backend._feed_rows([727], every_row=True)
        backend._remove_from(len(prompt))
        backend._len = len(prompt)
        block = backend._feed_rows([727, 13], every_row=True)[:1]
        assert backend.rows_match == torch.equal(lone, block)
        assert backend.min_rows == (1 if backend.rows_match else 2)
        assert backend.batch_noise == 0

        # the check compares rows: a lone row that differs in any bit is a `no`
        feed_rows = backend._feed_rows

        def lone_rows_apart(ids, every_row):
            rows = feed_rows(ids, every_row)
            return rows + 1e-3 if len(ids) == 1 else rows

        backend._feed_rows = lone_rows_apart
        assert backend.rows_alike() is False
        backend._feed_rows = lambda ids, every_row: torch.zeros(len(ids), 4)
        assert backend.rows_alike() is True
    finally:
        backend.close()
    for alike, blocks, rows in ((True, False, 1), (False, True, 2)):
        monkeypatch.setattr(IkLlamaBackend, "rows_alike", lambda self, a=alike: a)
        chosen = IkLlamaBackend(gguf, 1, "smollm", 512, True, None)
        try:
            assert chosen.min_rows == rows and ("-blocks2" in chosen.kind) == blocks
            assert chosen.batch_noise == 0
        finally:
            chosen.close()


def test_a_prompt_gives_its_final_hidden_state_for_the_router(smollm):
    """prefill(hidden_layer=num_layers): the last prompt token's final-layer state, read by a
    second lone pass with the embeddings output on. The logits and the cache stay what a
    plain prefill leaves (the next forward is bit for bit the same), and it crosses into a
    child process."""
    from adaspec.backends.process_backend import ProcessBackend
    from adaspec.errors import InputError

    gguf, backend = smollm
    prompt, other = torch.tensor([1604, 3987, 46477, 24, 94]), torch.tensor([727, 13, 55])
    backend.reset()
    plain = backend.prefill(prompt)
    after_plain = backend.forward(torch.tensor([300])).logits
    backend.reset()
    out = backend.prefill(prompt, hidden_layer=backend.num_layers)
    assert out.hidden is not None and out.hidden.shape == (1, backend.hidden_size)
    assert torch.isfinite(out.hidden).all() and out.hidden.abs().sum() > 0
    assert torch.equal(out.logits, plain.logits) and backend.cache_len == len(prompt)
    assert torch.equal(backend.forward(torch.tensor([300])).logits, after_plain)
    backend.reset()
    again = backend.prefill(prompt, hidden_layer=backend.num_layers).hidden
    assert torch.equal(again, out.hidden)
    backend.reset()
    assert not torch.equal(backend.prefill(other, hidden_layer=backend.num_layers).hidden,
                           out.hidden)
    with pytest.raises(InputError, match="final layer's state only"):
        backend.prefill(prompt, hidden_layer=backend.num_layers - 1)
    backend.reset()

    child = ProcessBackend(IkLlamaBackend, gguf, 1, "smollm", 512)
    try:
        assert child.has_hidden_states
        crossed = child.prefill(prompt, hidden_layer=child.num_layers)
        assert crossed.hidden is not None and torch.equal(crossed.hidden, out.hidden)
    finally:
        child.close()


def test_a_router_routes_over_an_ik_llama_target(smollm):
    """The router's prompt state now comes from the default runtime too: a routed request
    reads it from the prefill and decodes what the picked arm decodes alone."""
    from adaspec.methods.build import build_generator
    from adaspec.route.router import RoutedGenerator

    _, target = smollm
    target.reset()
    prompt = [1604, 3987, 46477, 24, 94, 727] * 3
    arms = {name: build_generator(f"{name}@ik", target, None, None, [2])
            for name in ("ar", "ngram:k=4")}
    alone = arms["ar"].generate(prompt, 16).token_ids
    router = RoutedGenerator(arms, force="ngram:k=4")
    routed = router.generate(prompt, 16)
    assert routed.token_ids == alone and routed.stats.route == "ngram:k=4"
    assert router.last_state is not None and router.last_state.shape == (target.hidden_size,)


def test_a_router_keeps_what_the_cache_holds_of_its_next_prompt(smollm):
    """A router's next request prefills only what its last request's prompt and answer do
    not cover (a chat template's system turn, a conversation's earlier turns), as an Engine
    does, and decodes what a fresh prefill decodes; `reuse=0` (a cold request) keeps none."""
    from adaspec.core.sampling import SamplingParams
    from adaspec.engine.batch import run_alone
    from adaspec.engine.steps import GenerationResult
    from adaspec.methods.build import build_generator
    from adaspec.route.router import RoutedGenerator

    _, target = smollm

    def router() -> RoutedGenerator:
        return RoutedGenerator({"ar": build_generator("ar@ik", target, None, None, [2])},
                               force="ar")

    first = [1604, 3987, 46477, 24, 94, 727] * 3
    target.reset()
    warm = router()
    answer = warm.generate(first, 8).token_ids
    turn = [*first, *answer, 300, 400, 500]
    again = warm.generate(turn, 12)
    assert again.stats.cached_tokens == len(first) + len(answer) - 1
    target.reset()
    fresh = router().generate(turn, 12)
    assert fresh.stats.cached_tokens == 0 and again.token_ids == fresh.token_ids
    cold = next(r for r in run_alone(warm.steps(turn, 4, SamplingParams(), [], reuse=0))
                if isinstance(r, GenerationResult))
    assert cold.stats.cached_tokens == 0 and cold.token_ids == fresh.token_ids[:4]

def test_sequences_share_one_cache_and_keep_apart(smollm):
    """Several sequences of one ik_llama.cpp context: a view alone scores what the backend's
    own sequence scores (chunked prefill included), views fed in one call get their own
    rows (not a neighbour's), a rollback of one leaves the other, and a call that finds no
    room in the cache fails with a clear error and leaves nothing behind."""
    from adaspec.backends.sequences import ALL, LAST, NONE, forward_together

    gguf, _ = smollm
    owner = IkLlamaBackend(gguf, n_threads=1, name="smollm", n_ctx=512, sequences=4)
    a, b = owner.sequences(2)
    p = [1604, 3987, 46477, 24, 94, 17, 400, 9, 2001, 36]
    q = [77, 78, 79, 80, 81, 82]
    want = owner.prefill(torch.tensor(p)).logits
    step = owner.forward(torch.tensor([5, 6, 7])).logits
    owner.reset()
    left = a.plan_prefill(p, 0)
    forward_together([(a, left[:4], NONE)])
    got = forward_together([(a, left[4:], LAST)])[0]
    assert torch.equal(got, want)  # alone: bit for bit, in chunks too
    assert torch.equal(a.forward(torch.tensor([5, 6, 7])).logits, step)
    a.truncate(len(p))
    b.prefill(torch.tensor(q))
    rows_a, rows_b = forward_together([(a, [5, 6, 7], ALL), (b, [8, 9], ALL)])
    assert rows_a.shape[0] == 3 and rows_b.shape[0] == 2
    # beside another sequence's cells the sums group otherwise: near, not bit-equal
    assert (rows_a - step).abs().max() < 1.0
    assert (rows_a.argmax(-1) == step.argmax(-1)).all()
    b.truncate(2)  # b's rollback leaves a's entries
    assert a.cache_len == len(p) + 3 and b.cache_len == 2
    again = a.forward(torch.tensor([11])).logits
    a.truncate(len(p) + 3)
    assert torch.equal(a.forward(torch.tensor([11])).logits, again)
    with pytest.raises(Exception, match="context too long|no room"):
        forward_together([(b, list(range(100, 700)), ALL)])
    assert b.cache_len == 2
    owner.close()


def test_sequences_share_a_prompt_prefix(smollm):
    """A prompt whose first tokens another sequence holds takes them from its cache (shared
    entries, not computed): it scores what the whole prompt computed alone scores; the
    donor's later rollback leaves the copy; a prefix shorter than MIN_SHARE is computed. A
    view that only claims the prefix without the entries (negative control) scores other
    logits, so the check can tell."""
    from adaspec.backends.sequences import MIN_SHARE

    gguf, _ = smollm
    owner = IkLlamaBackend(gguf, n_threads=1, name="smollm", n_ctx=512, sequences=4)
    a, b, c = owner.sequences(3)
    system = [(7 * i + 3) % 900 + 100 for i in range(MIN_SHARE + 4)]
    p, q = system + [1604, 3987, 46477, 24], system + [94, 17, 400, 9, 2001]
    want = owner.prefill(torch.tensor(q)).logits  # the owner's own sequence: no siblings
    want_next = owner.forward(torch.tensor([5])).logits
    a.prefill(torch.tensor(p))
    assert b.available_prefix(q, len(q)) == len(system) and b.available_prefix(q, 0) == 0
    left = b.plan_prefill(q, len(q))
    assert left == q[len(system):] and b.shared_tokens == len(system)
    got = b.prefill(torch.tensor(q), reuse=len(q)).logits  # scores the rest only
    assert (got - want).abs().max() < 1.0 and torch.equal(got.argmax(-1), want.argmax(-1))
    if owner.region:  # copied into b's region: bit for bit the whole prompt computed there
        assert torch.equal(got, want)
    a.truncate(2)  # the donor rolls back: the copy stays
    step = b.forward(torch.tensor([5])).logits
    assert (step - want_next).abs().max() < 1.0
    # negative control: the entries claimed, not copied
    c._token_ids().extend(system)
    c._len = len(system)
    wrong = c.prefill(torch.tensor(q), reuse=len(q)).logits
    assert c.shared_tokens == 0 and (wrong - want).abs().max() > 1.0
    # a prefix shorter than MIN_SHARE is computed, not shared
    c.reset()
    a.prefill(torch.tensor(system[: MIN_SHARE - 1] + [9, 9, 9]))
    short = system[: MIN_SHARE - 1] + [5, 5, 5]
    assert c.plan_prefill(short, len(short)) == short and c.shared_tokens == 0
    owner.close()


def test_batch_prefills_a_shared_prefix_once(smollm):
    """Requests that arrive together with a common system turn: the batch holds all but
    the first back a round, then each takes the turn from the first one's cache; every
    request decodes what it decodes alone."""
    from adaspec.backends.sequences import MIN_SHARE
    from adaspec.core.sampling import SamplingParams
    from adaspec.engine.batch import BatchDecoder
    from adaspec.engine.steps import GenerationResult
    from adaspec.methods.build import build_generator

    gguf, _ = smollm
    owner = IkLlamaBackend(gguf, n_threads=1, name="smollm", n_ctx=1024, sequences=4)
    system = [(11 * i + 5) % 900 + 100 for i in range(MIN_SHARE + 8)]
    prompts = [system + [1604 + i, 3987, 46477, 24 + i] for i in range(3)]
    alone = []
    for p in prompts:
        owner.reset()
        alone.append(build_generator("ar@ik", owner, None, None, [2]).generate(p, 8).token_ids)
    decoder = BatchDecoder()
    views = owner.sequences(3)
    for i, (view, p) in enumerate(zip(views, prompts, strict=True)):
        engine = build_generator("ar@ik", view, None, None, [2])
        decoder.add(i, engine.steps(p, 8, SamplingParams(), [], reuse=len(p)))
    together: dict[int, list[int]] = {}
    while len(decoder):
        for key, item in decoder.round():
            assert not isinstance(item, Exception), item
            if isinstance(item, GenerationResult):
                together[key] = item.token_ids
    assert [v.shared_tokens for v in views] == [0, len(system), len(system)]
    assert [together[i] for i in range(3)] == alone
    owner.close()


def test_routed_requests_decode_together_on_sequences(smollm):
    """The router on slots (`--max-batch`): each sequence gives its prompt's final state
    (the same the context's own sequence gives, read by a lone pass of that sequence's last
    token), and routed requests' decode steps share the batch's calls, each emitting what
    its arm emits alone."""
    from adaspec.backends.process_backend import ProcessBackend
    from adaspec.engine.batch import BatchDecoder
    from adaspec.engine.steps import GenerationResult
    from adaspec.methods.build import build_generator
    from adaspec.route.router import RoutedGenerator

    from .test_batch import run_together

    gguf, _ = smollm
    owner = ProcessBackend(IkLlamaBackend, str(gguf), 1, "smollm", 512, True, 1, 4)
    try:
        prompt = [1604, 3987, 46477, 24, 94, 727, 13, 55]
        own = owner.prefill(torch.tensor(prompt), hidden_layer=owner.num_layers).hidden
        views = owner.sequences(3)
        assert views[0].has_hidden_states
        out = views[0].prefill(torch.tensor(prompt), hidden_layer=owner.num_layers)
        assert out.hidden is not None and (out.hidden - own).abs().max() < 0.05
        assert views[0].cache_len == len(prompt)
        prompts = [prompt * 2, [727, 13, 55, 300] * 3, [94, 24, 94, 24, 17] * 3]
        picks = ["ar", "ngram:k=4", "ngram:k=4"]
        owner.reset()
        want = [build_generator(f"{p}@ik", owner, None, None, [2]).generate(q, 16).token_ids
                for p, q in zip(picks, prompts, strict=True)]
        routers = [RoutedGenerator({p: build_generator(f"{p}@ik", v, None, None, [2])
                                    for p in ("ar", "ngram:k=4")}, force=pick)
                   for v, pick in zip(views, picks, strict=True)]
        requests = {i: r.stream_steps(q, max_new_tokens=16)
                    for i, (r, q) in enumerate(zip(routers, prompts, strict=True))}
        results, _ = run_together(BatchDecoder(), requests)
        for i, pick in enumerate(picks):
            assert isinstance(results[i], GenerationResult)
            assert results[i].stats.route == pick
            assert results[i].token_ids == want[i]  # (no near-tie on these prompts)
        assert all(r.last_state is not None for r in routers)
    finally:
        owner.close()


def test_sequences_attend_their_own_cells_whatever_the_call_carries(smollm):
    """Several sequences with flash attention (the native build's `fa-multi-sequence` patch):
    after requests leave and others take their cells, a sequence's next-token row is bit
    for bit the same alone, beside other requests, as a later row of the call and as the
    first of a chain. (The pinned library's own kernel cut a group of rows at its last
    row's cells and aborted on this layout; without flash attention the row's sums group
    by its place in the call.)"""
    from adaspec.backends.sequences import ALL, forward_together

    gguf, _ = smollm
    owner = IkLlamaBackend(gguf, n_threads=1, name="smollm", n_ctx=2048, sequences=7)
    if not owner.flash_attention:
        owner.close()
        pytest.skip("this ik_llama.cpp library lacks the fa-multi-sequence patch")
    views = owner.sequences(6)

    def prompt(seed: int, n: int) -> list[int]:
        return [(seed * 7919 + 104729 * i) % 40000 + 100 for i in range(n)]

    for i, view in enumerate(views):
        view.prefill(torch.tensor(prompt(i, 40 + 37 * i)))
    for i in (4, 1, 2):  # they leave; new requests take their cells
        views[i].reset()
    for i in (2, 4, 1):
        views[i].prefill(torch.tensor(prompt(10 + i, 60 + 23 * i)))
    a, others = views[0], views[1:]
    lengths = [v.cache_len for v in views]

    def row_of_a(items: list, at: int) -> torch.Tensor:
        rows = forward_together(items)
        for view, n in zip(views, lengths, strict=True):
            view.truncate(n)
        return rows[at][0]

    alone = row_of_a([(a, [77], ALL)], 0)
    calls = {
        "first of 6": ([(a, [77], ALL)] + [(v, [88], ALL) for v in others], 0),
        "last of 6": ([(v, [88], ALL) for v in others] + [(a, [77], ALL)], 5),
        "third of 4": ([(v, [88], ALL) for v in others[:2]]
                       + [(a, [77], ALL), (others[2], [9], ALL)], 2),
        "a chain of 4 beside 5": ([(a, [77, 78, 79, 80], ALL)]
                                  + [(v, [88], ALL) for v in others], 0),
    }
    for name, (items, at) in calls.items():
        assert torch.equal(row_of_a(items, at), alone), name
    owner.close()


class _ViewCell(ctypes.Structure):
    _fields_ = [("pos", ctypes.c_int32)]


class _CacheView(ctypes.Structure):  # llama.h's llama_kv_cache_view
    _fields_ = [("n_cells", ctypes.c_int32), ("n_seq_max", ctypes.c_int32),
                ("token_count", ctypes.c_int32), ("used_cells", ctypes.c_int32),
                ("max_contiguous", ctypes.c_int32), ("max_contiguous_idx", ctypes.c_int32),
                ("cells", ctypes.POINTER(_ViewCell)),
                ("cells_sequences", ctypes.POINTER(ctypes.c_int32))]


def _cells(owner: IkLlamaBackend) -> dict[tuple[int, int], list[int]]:
    """(sequence, position) -> the cells holding it, read through llama.h's cache view."""
    lib = owner._lib
    lib.llama_kv_cache_view_init.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    lib.llama_kv_cache_view_init.restype = _CacheView
    lib.llama_kv_cache_view_update.argtypes = [ctypes.c_void_p, ctypes.POINTER(_CacheView)]
    lib.llama_kv_cache_view_free.argtypes = [ctypes.POINTER(_CacheView)]
    view = lib.llama_kv_cache_view_init(owner._ctx, 4)
    lib.llama_kv_cache_view_update(owner._ctx, ctypes.byref(view))
    out: dict[tuple[int, int], list[int]] = {}
    for cell in range(view.n_cells):
        pos = view.cells[cell].pos
        for k in range(4):
            seq = view.cells_sequences[cell * 4 + k]
            if pos >= 0 and seq >= 0:
                out.setdefault((seq, pos), []).append(cell)
    lib.llama_kv_cache_view_free(ctypes.byref(view))
    return out


def test_each_sequence_keeps_to_its_region_and_overflows_past_the_regions(smollm,
                                                                            monkeypatch):
    """With the native build's `kv-regions` patch, sequence s's position p sits in cell
    s * region + p whatever the others do; a position past the region, or a cell another
    sequence still shares, takes the next free cell past the regions instead."""
    from adaspec.backends.sequences import ALL, forward_together

    gguf, _ = smollm
    monkeypatch.setattr(ikllama, "REGION_TOKENS", 256)  # 4 regions of 256 cells, then 1024
    owner = IkLlamaBackend(gguf, n_threads=1, name="smollm", n_ctx=2048, sequences=4)
    if not owner.region:
        owner.close()
        pytest.skip("this ik_llama.cpp library lacks the kv-regions patch")
    assert owner.region == 256 and owner.kind.removesuffix("-narrow").endswith("-regions")
    a, b, c = owner.sequences(3)

    def prompt(seed: int, n: int) -> list[int]:
        return [(seed * 7919 + 104729 * i) % 40000 + 100 for i in range(n)]

    shared = prompt(1, 60)
    a.prefill(torch.tensor(shared + prompt(2, 20)))
    b.prefill(torch.tensor(shared + prompt(3, 250)), reuse=330)  # a's 60, then past its region
    assert b.shared_tokens == 60
    a.reset()  # a leaves: b's copy of the 60 is its own
    a.prefill(torch.tensor(prompt(4, 100)))
    c.prefill(torch.tensor(prompt(5, 50)))
    forward_together([(v, [7 + i], ALL) for i, v in enumerate((a, b, c))])
    cells = _cells(owner)
    assert all(len(held) == 1 for held in cells.values())  # one cell per token
    assert len(cells) == a.cache_len + b.cache_len + c.cache_len
    at = {key: held[0] for key, held in cells.items()}
    assert all(at[(3, p)] == 3 * 256 + p for p in range(c.cache_len))
    assert all(at[(2, p)] == 2 * 256 + p for p in range(256))  # the shared 60 copied in
    assert all(at[(1, p)] == 256 + p for p in range(a.cache_len))
    # b's positions past its region: the cells past the regions, in order
    past = {at[(2, p)] for p in range(256, b.cache_len)}
    assert past == set(range(1024, 1024 + len(past))) and len(past) == b.cache_len - 256
    # a cell another sequence still holds (a prefix shared without regions' copy) is not
    # taken: the token goes past the regions
    owner._lib.llama_kv_cache_seq_rm(owner._ctx, 1, 0, -1)
    owner._lib.llama_kv_cache_seq_cp(owner._ctx, 3, 1, 0, 10)  # c's cells tagged for a too
    a._token_ids()[:] = prompt(5, 10)
    a._len = 10
    c.reset()
    c.prefill(torch.tensor(prompt(6, 20)))
    at = {key: held[0] for key, held in _cells(owner).items()}
    assert all(at[(1, p)] == 3 * 256 + p for p in range(10))
    assert all(at[(3, p)] >= 1024 for p in range(10))
    assert all(at[(3, p)] == 3 * 256 + p for p in range(10, 20))
    owner.close()


def test_a_row_scores_alike_in_any_call_any_slot_and_a_context_of_one(smollm):
    """One attention path for every row (`kv-regions`): a sequence's logits are bit for bit
    the same whether its context holds one sequence or several, whichever slot it has,
    fed alone, as a chain, beside other sequences or as a prompt chunk, and after its
    prefix was copied from another slot. Two threads, so the pinned kernel's split of a
    lone row's cells among threads would show; the prompt (150 rows) and the block of 12 are
    attended as rows together, the lone steps row by row."""
    from adaspec.backends.sequences import ALL, forward_together

    gguf, _ = smollm
    single = IkLlamaBackend(gguf, n_threads=2, name="smollm", n_ctx=1024)
    if not single.region:
        single.close()
        pytest.skip("this ik_llama.cpp library lacks the kv-regions patch")
    owner = IkLlamaBackend(gguf, n_threads=2, name="smollm", n_ctx=2048, sequences=5)

    def prompt(seed: int, n: int) -> list[int]:
        return [(seed * 7919 + 104729 * i) % 40000 + 100 for i in range(n)]

    p = prompt(1, 150)
    steps = prompt(2, 12)
    want = [single.prefill(torch.tensor(p)).logits]
    for tok in steps:  # plain decoding: one lone row a call
        want.append(single.forward(torch.tensor([tok])).logits)
    want_t = torch.cat(want)  # [1 + len(steps), V]: the last prompt row, then each step's
    chain = single
    chain.truncate(len(p))
    got_chain = chain.forward(torch.tensor(steps)).logits  # one block of 12
    assert torch.equal(got_chain, want_t[1:])
    single.close()

    a, b, c, d = owner.sequences(4)
    for i, v in enumerate((a, c, d)):
        v.prefill(torch.tensor(prompt(10 + i, 90 + 40 * i)))
    got = [b.prefill(torch.tensor(p)).logits]  # slot 2, others beside it
    for j, tok in enumerate(steps):  # each step in a call with the others' rows
        others = [(v, [5 + j], ALL) for v in (a, c, d)][: j % 4]
        rows = forward_together([*others[:1], (b, [tok], ALL), *others[1:]])
        got.append(rows[1 if others else 0])
    assert torch.equal(torch.cat(got), want_t)
    # the prompt copied into another slot's region, then a chain of the steps
    d.reset()
    assert d.plan_prefill(p + steps[:1], len(p) + 1) == steps[:1] and d.shared_tokens == len(p)
    out = forward_together([(d, steps[:1] + steps[1:], ALL), (a, [3, 4], ALL)])[0]
    assert torch.equal(out, want_t[1:])
    owner.close()


def test_the_load_probe_finds_whether_sequences_score_alike(smollm, monkeypatch):
    """At load a context of several sequences checks that sequence 1 scores a token as
    sequence 0 does (alone, beside it, in a block): with the one attention path it does and
    greedy verification needs no recheck (batch noise 0); with regions off (flash attention
    over freely placed cells, the pinned kernel's paths) it does not, and near-ties are
    rechecked."""
    gguf, _ = smollm
    owner = IkLlamaBackend(gguf, n_threads=2, name="smollm", n_ctx=1024, sequences=3,
                           min_rows=None)
    if not owner.region:
        owner.close()
        pytest.skip("this ik_llama.cpp library lacks the kv-regions patch")
    assert owner.sequences_match and owner.batch_noise == 0.0
    owner.close()
    monkeypatch.setenv(ikllama.REGIONS_ENV, "off")
    free = IkLlamaBackend(gguf, n_threads=2, name="smollm", n_ctx=1024, sequences=3,
                          min_rows=None)
    assert free.flash_attention and not free.region
    assert not free.sequences_match and free.batch_noise > 0
    free.close()


def test_the_target_features_come_with_the_logits_from_one_pass(smollm):
    """With the features patch (`ik/patches/features.py`), a pass returns each output row's
    final-normed state beside its logits: the logits bit for bit those of a pass without,
    the last prompt row's state the router's final state (read by a second pass), and the
    same across a child process."""
    from adaspec.backends.process_backend import ProcessBackend
    from adaspec.backends.sequences import ALL, Feed
    from adaspec.errors import InputError

    gguf, backend = smollm
    ids = [1604, 3987, 46477, 24, 94]
    if not backend.has_features:
        with pytest.raises(InputError, match="adaspec runtime build --force"):
            backend.record_features(True)
        pytest.skip("the loaded ik_llama.cpp library has no features patch (the wheel's, or "
                    "a build from before it): adaspec runtime build --force")
    backend.reset()
    plain = backend.feed_many([Feed(0, 0, ids, ALL)])[0]
    assert backend.last_features is None
    backend.remove_seq(0, 0)
    backend.record_features(True)
    try:
        both = backend.feed_many([Feed(0, 0, ids, ALL)])[0]
        feats = backend.last_features
        assert feats is not None and feats[0].shape == (len(ids), backend.hidden_size)
        assert torch.equal(both, plain)
        backend.remove_seq(0, 0)
    finally:
        backend.record_features(False)
    backend.reset()
    state = backend.prefill(torch.tensor(ids), hidden_layer=backend.num_layers).hidden
    assert state is not None and torch.equal(feats[0][-1:], state)
    backend.reset()
    child = ProcessBackend(IkLlamaBackend, gguf, 1, "smollm", 512)
    try:
        assert child.has_features
        child.record_features(True)
        crossed = child.feed_many([Feed(0, 0, ids, ALL)])[0]
        assert torch.equal(crossed, plain) and child.last_features is not None
        assert torch.equal(child.last_features[0], feats[0])
        child.remove_seq(0, 0)
        # the engine's own calls: a prompt's last row, then a chain's every row
        first = child.prefill(torch.tensor(ids[:3]))
        assert first.features is not None and torch.equal(first.features, feats[0][2:3])
        rest = child.forward(torch.tensor(ids[3:]))
        assert torch.equal(rest.logits, plain[3:])
        assert rest.features is not None and torch.equal(rest.features, feats[0][3:])
    finally:
        child.close()


def _tree_or_skip(backend) -> None:
    if not backend.supports_trees:
        backend.close()
        pytest.skip("this ik_llama.cpp library lacks the kv-tree patch: adaspec runtime build "
                    "--force")


def test_a_tree_scores_each_node_as_its_chain_and_keeps_its_path_bit_for_bit(smollm):
    """`ik/patches/tree.py`: every node of a token tree scored in one call gets bit for bit
    the logits of the chain root -> ... -> node (siblings hidden, its cells summed in the
    chain's order), and after keeping a path through side nodes the cache decodes on
    exactly as plain decoding of that path does. Two threads; trees as rows together (9
    rows) and apart (3)."""
    from adaspec.core.token_tree import TokenTree
    from adaspec.errors import InputError

    gguf, _ = smollm
    b = IkLlamaBackend(gguf, n_threads=2, name="smollm", n_ctx=1024)
    _tree_or_skip(b)
    prompt = [(7919 * 3 + 104729 * i) % 40000 + 100 for i in range(160)]
    root = len(prompt) - 1

    def chain(tokens: list[int]) -> torch.Tensor:
        b.truncate(root)
        return b.forward(torch.tensor([prompt[-1], *tokens])).logits

    b.prefill(torch.tensor(prompt))
    small = TokenTree.root(prompt[-1])
    small.add_level([0, 0], [311, 4242])
    big = TokenTree.root(prompt[-1])
    one = big.add_level([0, 0, 0], [501, 502, 503])
    two = big.add_level([one[0], one[0], one[1]], [601, 602, 603])
    big.add_level([two[0], two[2]], [701, 702])
    for tree in (small, big):
        b.truncate(root)
        toks, pos, mask = tree.flatten(root)
        rows = b.forward(toks, pos, mask).logits.clone()
        for node in range(len(tree)):
            path, a = [], node
            while a:
                path.append(tree.tokens[a])
                a = tree.parents[a]
            assert torch.equal(rows[node], chain(path[::-1])[-1]), f"node {node}"
    # keep a path through side nodes (502 -> 603 -> 702), then decode on
    b.truncate(root)
    toks, pos, mask = big.flatten(root)
    b.forward(toks, pos, mask)
    b.keep(torch.tensor([*range(root + 1), root + 2, root + 6, root + 8]))
    assert b.cache_len == root + 4 and b.held()[-3:] == [502, 603, 702]
    after = b.forward(torch.tensor([42, 43])).logits
    assert torch.equal(after, chain([502, 603, 702, 42, 43])[-2:])
    # a tree that would cross a block of the attention kernel's cells is refused
    b.truncate(127)
    assert b.tree_room(127) == 1
    with pytest.raises(InputError, match="at most 1 tokens"):
        b.forward(*small.flatten(127))
    b.close()


def test_greedy_trees_through_a_child_decode_what_plain_decoding_does(smollm):
    """The engine's tree steps on the default runtime's child process: a drafter whose every
    level puts plain decoding's token second among wrong ones, so accepted paths run through
    side nodes; the output is plain decoding's, the verification calls fewer than the
    tokens, and a step whose tree would cross a block of cells drafts a chain. The same on a
    server's slot (a sequence of a context of several)."""
    from adaspec.backends.process_backend import ProcessBackend
    from adaspec.control.static import StaticLength
    from adaspec.core.proposal import Proposal
    from adaspec.core.token_tree import TokenTree
    from adaspec.draft.base import Drafter
    from adaspec.engine.loop import Engine

    gguf, _ = smollm
    target = ProcessBackend(IkLlamaBackend, gguf, 2, "smollm", 1024, True, None)  # a target
    if not target.supports_trees:
        target.close()
        pytest.skip("this ik_llama.cpp library lacks the kv-tree patch: adaspec runtime build "
                    "--force")
    plain = Engine(target, None, eos_token_ids=[])
    prompt = [(7919 * 5 + 104729 * i) % 40000 + 100 for i in range(110)]
    want = plain.generate(prompt, max_new_tokens=40).token_ids
    reference = prompt + want

    class SecondIsRight(Drafter):
        drafts_trees = True
        rooms: list[int | None] = []

        def propose(self, req, max_tokens, controller):
            n = len(req.context)
            self.rooms.append(req.tree_nodes)
            tree = TokenTree.root(req.context[-1])
            parent = 0
            for d in range(max_tokens):
                if req.tree_nodes is not None and len(tree) + 2 > req.tree_nodes:
                    break
                right = reference[n + d] if n + d < len(reference) else 5
                new = tree.add_level([parent, parent], [(right + 17) % 40000 + 100, right])
                parent = new[1]
            return Proposal(tree)

    drafter = SecondIsRight()
    engine = Engine(target, None, drafter=drafter, controller=StaticLength(3), eos_token_ids=[])
    got = engine.generate(prompt, max_new_tokens=40)
    assert got.token_ids == want
    assert got.stats.accepted > 20 and got.stats.target_calls < 20
    assert any(r is not None and r < 7 for r in drafter.rooms)  # near cell 128: less room
    target.close()
    # a server's slot: a sequence of a context of several, in its own region, others beside
    server = ProcessBackend(IkLlamaBackend, gguf, 2, "smollm", 1024, True, None, 3)
    try:
        busy, slot = server.sequences(2)
        assert slot.supports_trees and slot.tree_room(40) == 88
        busy.prefill(torch.tensor(prompt[:70]))
        got = Engine(slot, None, drafter=SecondIsRight(), controller=StaticLength(3),
                     eos_token_ids=[]).generate(prompt, max_new_tokens=40)
        assert got.token_ids == want and got.stats.accepted > 20
    finally:
        server.close()
