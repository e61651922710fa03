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

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from adaspec.errors import AdaspecError, InputError
from adaspec.metrics import RequestStats

INSTALL_HINT = (
    "pip install 'adaspec[llamacpp]' (builds llama-cpp-python from source, about 8 minutes)"
)
DEFAULT_CONTEXT = 8192  # tokens; grown (by reloading) when a prompt needs more
# llama.cpp's "extra buffer types" repack weights for AMX / AVX-512 kernels. On this machine's
# VM the AMX matmul (used for batches of more than one token) crashes the process with a
# segfault in ggml_backend_amx_mul_mat, so they are off unless this variable is set to 1.
EXTRA_BUFFERS_ENV = "ADASPEC_LLAMACPP_EXTRA_BUFFERS"


class LlamaCppUnavailable(AdaspecError):
    """llama.cpp cannot run here (extra not installed, or no GGUF file for the target)."""


def import_llama() -> type:
    """The `llama_cpp.Llama` class, or LlamaCppUnavailable naming the install command."""
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise LlamaCppUnavailable(
            f"llama-cpp-python is not installed ({exc}): {INSTALL_HINT}"
        ) from None
    return Llama


def target_gguf(target: str) -> Path | None:
    """The verified GGUF file behind a target: a built-in model's assembled file (checked
    against the registry's size and sha256, assembled first if needed) or a .gguf path;
    None for a Hugging Face directory (no GGUF)."""
    from adaspec.models.assembly import assemble, check_gguf_magic
    from adaspec.models.registry import get_registry

    if target in get_registry():
        return assemble(target)
    path = Path(target).expanduser()
    if not path.is_file():
        return None
    check_gguf_magic(path)
    return path.resolve()


@contextmanager
def _model_params(extra_buffers: bool) -> Iterator[None]:
    """`Llama()` takes no `use_extra_bufts` argument: set it in the default model parameters
    it starts from, for the duration of one load."""
    from llama_cpp import llama_cpp as lib

    default = lib.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = extra_buffers
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = default


class LlamaCppDecoder:
    """Greedy decoding through llama-cpp-python with its own KV cache."""

    def __init__(self, gguf: str | Path, n_threads: int, n_ctx: int = DEFAULT_CONTEXT) -> None:
        self._llama = import_llama()
        self.gguf = Path(gguf)
        self.n_threads = n_threads
        self.extra_buffers = os.environ.get(EXTRA_BUFFERS_ENV) == "1"
        self.n_ctx = 0
        self.max_context = 0  # the model's training context, known once loaded
        self.llm = None
        self._load(n_ctx)

    def _load(self, n_ctx: int) -> None:
        self.llm = None  # free the old context before allocating the new one
        try:
            with _model_params(self.extra_buffers):
                self.llm = self._llama(
                    model_path=str(self.gguf),
                    n_ctx=min(n_ctx, self.max_context) if self.max_context else n_ctx,
                    n_threads=self.n_threads,
                    n_threads_batch=self.n_threads,
                    logits_all=False,
                    verbose=False,
                )
        except (ValueError, RuntimeError) as exc:
            raise LlamaCppUnavailable(f"llama.cpp could not load {self.gguf}: {exc}") from None
        import llama_cpp

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


def open_decoder(gguf: str | Path | None, temperature: float) -> LlamaCppDecoder:
    """The decoder for the bench's `llamacpp` method, with as many threads as torch uses (the
    same cores for every method); LlamaCppUnavailable says why it cannot run."""
    import torch

    import_llama()
    if temperature != 0:
        raise LlamaCppUnavailable("it decodes greedily only (temperature 0)")
    if gguf is None:
        raise LlamaCppUnavailable(
            "the target is not a GGUF file (llama.cpp runs GGUF only): use a built-in model "
            "name or a .gguf path as --target"
        )
    return LlamaCppDecoder(gguf, n_threads=torch.get_num_threads())
