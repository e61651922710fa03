"""llama.cpp plain decoding of the same GGUF target: the yardstick a CPU user would pick.

`llama-cpp-python` is an optional extra (`pip install 'adaspec[llamacpp]'`; it builds
llama.cpp from source, about 8 minutes on 2 cores), so everything here imports it lazily and
reports a missing install as a reason to skip, never as an error.

The decoder is fed the very prompt token ids adaspec's `encode_prompt` produced (no text, no
BOS added), decodes greedily (argmax of the last token's logits, first index on ties, as
llama.cpp's greedy sampler) and stops on the same EOS ids and token budget. Timing matches
the engine's: the clock starts before the prefill and stops after the last token, model
loading excluded; the prefill counts as a target call, then one call per further token.
"""

from __future__ import annotations

import time
from pathlib import Path

from adaspec.errors import InputError
from adaspec.metrics import RequestStats
from adaspec.models.llamacpp import (
    DEFAULT_CONTEXT,
    LlamaCppUnavailable,
    import_llama,
    load_llama,
)

__all__ = ["LlamaCppDecoder", "LlamaCppUnavailable", "open_decoder"]

class LlamaCppDecoder:
    """Greedy decoding through llama-cpp-python with its own KV cache."""

    def __init__(self, gguf: str | Path, n_threads: int, n_ctx: int = DEFAULT_CONTEXT) -> None:
        self.gguf = Path(gguf)
        self.n_threads = n_threads
        self._load(n_ctx)

    def _load(self, n_ctx: int) -> None:
        import llama_cpp

        self.llm = None  # free the old context before allocating the new one
        self.llm = load_llama(self.gguf, n_ctx, self.n_threads)
        self.n_ctx = int(self.llm.n_ctx())
        self.n_vocab = int(self.llm.n_vocab())
        self.max_context = int(llama_cpp.llama_model_n_ctx_train(self.llm.model))

    def _last_argmax(self) -> int:
        import llama_cpp
        import numpy as np

        logits = np.ctypeslib.as_array(
            llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,)
        )
        return int(logits.argmax())

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: list[int]
    ) -> tuple[list[int], RequestStats]:
        """Greedy new tokens after `prompt_ids` and engine-compatible stats."""
        need = len(prompt_ids) + max_new_tokens
        if need > self.max_context:
            raise InputError(
                f"llamacpp: prompt {len(prompt_ids)} + {max_new_tokens} new tokens exceeds the "
                f"model's context of {self.max_context}"
            )
        if need > self.n_ctx:
            self._load(min(self.max_context, max(need, 2 * self.n_ctx)))
        eos = set(eos_token_ids)
        stats = RequestStats(prompt_tokens=len(prompt_ids))
        llm = self.llm
        t_start = time.perf_counter()
        llm.reset()
        llm.eval(list(prompt_ids))
        token = self._last_argmax()
        stats.target_calls = 1
        stats.prefill_time = time.perf_counter() - t_start
        out: list[int] = []
        while True:
            out.append(token)
            if token in eos or len(out) >= max_new_tokens:
                break
            t0 = time.perf_counter()
            llm.eval([token])
            token = self._last_argmax()
            stats.verify_time += time.perf_counter() - t0
            stats.target_calls += 1
        stats.wall_time = time.perf_counter() - t_start
        stats.new_tokens = len(out)
        return out, stats


def open_decoder(gguf: str | Path | None, temperature: float, isolated: bool = True):
    """The decoder for the bench's `llamacpp` method, with as many threads as torch uses (the
    same cores for every method), in a child process unless `isolated` is False;
    LlamaCppUnavailable says why it cannot run."""
    import torch

    import_llama()
    if temperature != 0:
        raise LlamaCppUnavailable("it decodes greedily only (temperature 0)")
    if gguf is None:
        raise LlamaCppUnavailable(
            "the target is not a GGUF file (llama.cpp runs GGUF only): use a built-in model "
            "name or a .gguf path as --target"
        )
    threads = torch.get_num_threads()
    if isolated:
        return ChildDecoder(gguf, threads)
    return LlamaCppDecoder(gguf, n_threads=threads)


class ChildDecoder:
    """`LlamaCppDecoder.generate` served by a child process: the torch methods of the bench
    run alone in theirs, and a crash in llama.cpp is a LlamaCppUnavailable, not a lost run.
    Timing is taken inside the child, as in-process (the round trip is outside the clock)."""

    def __init__(self, gguf: str | Path, n_threads: int) -> None:
        from adaspec.models.child_process import ChildProcess

        self._child = ChildProcess(LlamaCppDecoder, str(gguf), n_threads,
                                   error=LlamaCppUnavailable)

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: list[int]
    ) -> tuple[list[int], RequestStats]:
        return self._child.call(
            "generate", [int(t) for t in prompt_ids], max_new_tokens, list(eos_token_ids)
        )

    def close(self) -> None:
        self._child.close()
