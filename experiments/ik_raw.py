"""ik_llama.cpp's C API driven directly, for the experiments that time single `llama_decode`
calls on a cache of several sequences (`batch_slack.py`, `ik_attention.py`): the model
loaded as adaspec loads it (repacked), one context whose KV cache the sequences share, each
call's rows placed by hand and rolled back after."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from adaspec.backends.gguf import gguf_backend_args
from adaspec.backends.ik.backend import library
from adaspec.backends.weights import llama_threads

CHUNK = 256  # prompt tokens a filling call carries


def load_model(target: str, repack: bool = True) -> tuple[Any, Any, Any]:
    """(binding module, library, model) for `target`'s GGUF, repacked as adaspec runs it
    (`repack=False`: the GGUF's own layout, for comparison)."""
    api = library()
    lib = api.adaspec_lib
    gguf = gguf_backend_args(target, llama_threads(), 8192, library)[0]
    params = lib.llama_model_default_params()
    params.n_gpu_layers = 0
    params.repack_tensors = repack
    return api, lib, lib.llama_model_load_from_file(str(gguf).encode(), params)


class Context:
    """One context of `sequences` sequences; `lengths[s]` is what sequence s holds."""

    def __init__(self, lib: Any, model: Any, flash: bool, sequences: int,
                 n_ctx: int = 16384) -> None:
        self.lib = lib
        self.flash = flash
        cp = lib.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = 512
        cp.n_seq_max = sequences
        cp.n_threads = cp.n_threads_batch = llama_threads()
        cp.flash_attn = flash
        self.ctx = lib.llama_init_from_model(model, cp)
        self.batch = lib.llama_batch_init(512, 0, sequences)
        self.n_vocab = int(lib.llama_n_vocab(model))
        self.lengths = [0] * sequences

    def decode(self, rows: list[tuple[int, int, int]], want: set[int] = frozenset(),
               every_row: bool = False) -> tuple[float, dict[int, np.ndarray]]:
        """rows: (sequence, position, token); seconds of the call and the logits of the rows
        in `want` (every_row: the call computes every row's, as verification does)."""
        b = self.batch
        for i, (seq, pos, tok) in enumerate(rows):
            b.token[i], b.pos[i] = tok, pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = every_row or i in want
        b.n_tokens = len(rows)
        t0 = time.perf_counter()
        code = self.lib.llama_decode(self.ctx, b)
        seconds = time.perf_counter() - t0
        assert code == 0, code
        return seconds, {i: np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i),
                                                  (self.n_vocab,)).copy() for i in want}

    def feed(self, seq: int, ids: list[int]) -> None:
        """Append `ids` to sequence `seq`, CHUNK tokens a call."""
        for start in range(0, len(ids), CHUNK):
            n = self.lengths[seq]
            self.decode([(seq, n + i, t) for i, t in enumerate(ids[start:start + CHUNK])])
            self.lengths[seq] += len(ids[start:start + CHUNK])

    def fill(self, seq: int, upto: int, rng: random.Random) -> None:
        """Random tokens until sequence `seq` holds `upto`."""
        self.feed(seq, [rng.randrange(1000, 30000) for _ in range(upto - self.lengths[seq])])

    def leave(self, seq: int) -> None:
        self.lib.llama_kv_cache_seq_rm(self.ctx, seq, 0, -1)
        self.lengths[seq] = 0

    def roll_back(self) -> None:
        """Drop whatever the last calls added beyond `lengths`."""
        for seq, n in enumerate(self.lengths):
            self.lib.llama_kv_cache_seq_rm(self.ctx, seq, n, -1)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


def suite_sequences(target: str, sequences: int, prompt_tokens: int = 200
                    ) -> tuple[Any, Any, Any, Context]:
    """The target loaded as `serve --max-batch` runs it (its multi-sequence flash attention)
    and a context of `sequences` sequences, each prefilled with the first `prompt_tokens`
    tokens of a bench prompt (HumanEval, WMT, ShareGPT and code editing in turn): (api,
    lib, model, context). The batched-call experiments time their shapes after these."""
    from adaspec.backends.ik.backend import multi_sequence_flash
    from adaspec.lab.bench.suites import load_suite
    from adaspec.store.model_store import load_tokenizer

    tokenizer = load_tokenizer(target, "bfloat16")
    api, lib, model = load_model(target)
    ctx = Context(lib, model, flash=multi_sequence_flash(api), sequences=sequences, n_ctx=8192)
    per_suite = -(-sequences // 4)
    prompts = []
    for suite in ("humaneval", "wmt", "sharegpt", "codeedit"):
        prompts += load_suite(suite, per_suite)
    for seq, prompt in enumerate(prompts[:sequences]):
        ctx.feed(seq, tokenizer(prompt.text)["input_ids"][:prompt_tokens])
    return api, lib, model, ctx


def write_results(out: str | Path, stem: str, record: dict, lines: list[str]) -> None:
    """`record` as OUT/STEM.json and the table `lines` as OUT/STEM.md (also printed)."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(record, indent=2))
    (folder / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
