"""llama.cpp (through llama-cpp-python) behind the model backend interface.

A GGUF model run by llama.cpp as a `ModelBackend`, so it can serve as the draft (or the
target) in adaspec's loop: a Q4_K_M draft step costs a fraction of a bf16 torch step on this
CPU. It scores chains only (no tree masks, no hidden states): forward feeds tokens after the
cache and returns logits for every fed token; truncate drops cache entries from a position on
(`llama_memory_seq_rm`).

`llama-cpp-python` is an optional extra (`pip install 'adaspec[llamacpp]'`; it builds
llama.cpp from source, about 8 minutes on 2 cores), imported lazily: a missing install is a
LlamaCppUnavailable naming the command, never a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from adaspec.backends.base import ChainBackend
from adaspec.errors import AdaspecError

INSTALL_HINT = (
    "pip install 'adaspec[llamacpp]' (builds llama-cpp-python from source, about 8 minutes)"
)
DEFAULT_CONTEXT = 8192  # tokens
# llama.cpp's "extra buffer types" repack weights for AMX / AVX-512 kernels. On this machine's
# VM the AMX matmul (used for batches of more than one token) crashes the process with a
# segfault in ggml_backend_amx_mul_mat, so they are off unless this variable is set to 1.
EXTRA_BUFFERS_ENV = "ADASPEC_LLAMACPP_EXTRA_BUFFERS"


# The weights variant (`--quant gguf`, `NAME@gguf`) that runs a model's GGUF through llama.cpp.
GGUF = "gguf"


class LlamaCppUnavailable(AdaspecError):
    """llama.cpp cannot run here (extra not installed, or no GGUF file for the model)."""


def gguf_file(model: str) -> Path | None:
    """The verified GGUF file behind a model: a built-in model's assembled file (checked
    against the registry's size and sha256, assembled first if needed) or a .gguf path;
    None for a Hugging Face directory (no GGUF)."""
    from adaspec.store.assembly import assemble, check_gguf_magic
    from adaspec.store.catalog import get_registry

    if model in get_registry():
        return assemble(model)
    path = Path(model).expanduser()
    if not path.is_file():
        return None
    check_gguf_magic(path)
    return path.resolve()


def checked_gguf(model: str, runtime: str = GGUF) -> Path:
    """The verified GGUF file llama.cpp (runtime `gguf`) or ik_llama.cpp (`ik`) runs for a
    built-in model or .gguf path, or LlamaCppUnavailable / IkLlamaUnavailable (the package
    missing, or no GGUF behind the model)."""
    if runtime == GGUF:
        import_llama()  # a missing extra is reported before any file work
    else:
        from adaspec.backends.ikllama import library

        library()
    path = gguf_file(model)
    if path is None:
        raise LlamaCppUnavailable(
            f"{model} has no GGUF file for llama.cpp (a Hugging Face directory); use a "
            "built-in model name or a .gguf path"
        )
    return path


def gguf_backend_args(
    model: str, n_threads: int, n_ctx: int = DEFAULT_CONTEXT, runtime: str = GGUF
) -> tuple[Path, int, str, int]:
    """The arguments of `LlamaCppBackend` (runtime `gguf`) or `IkLlamaBackend` (`ik`) for a
    built-in model or .gguf path: the checked file, named as the torch loader names the same
    source (artifacts compare these names). In this process or a child's, the backend is
    built from these."""
    from adaspec.store.loading import source_name

    return checked_gguf(model, runtime), n_threads, source_name(model), n_ctx


def load_gguf_backend(model: str, n_threads: int, n_ctx: int = DEFAULT_CONTEXT) -> LlamaCppBackend:
    """A built-in model or .gguf path run by llama.cpp as a backend in this process."""
    return LlamaCppBackend(*gguf_backend_args(model, n_threads, n_ctx))


def import_llama() -> type:
    """The `llama_cpp.Llama` class, or LlamaCppUnavailable naming the install command."""
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise LlamaCppUnavailable(
            f"llama-cpp-python is not installed ({exc}): {INSTALL_HINT}"
        ) from None
    return Llama


@contextmanager
def model_params_with_extra_buffers(extra_buffers: bool) -> Iterator[None]:
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


def load_llama(gguf: str | Path, n_ctx: int, n_threads: int):
    """A `llama_cpp.Llama` for a GGUF file (quiet, last-token logits by default, the context
    capped at the model's training length)."""
    llama = import_llama()
    import llama_cpp

    extra = os.environ.get(EXTRA_BUFFERS_ENV) == "1"
    try:
        with model_params_with_extra_buffers(extra):
            llm = llama(
                model_path=str(gguf),
                n_ctx=n_ctx,
                n_threads=n_threads,
                n_threads_batch=n_threads,
                logits_all=False,
                verbose=False,
            )
    except (ValueError, RuntimeError) as exc:
        raise LlamaCppUnavailable(f"llama.cpp could not load {gguf}: {exc}") from None
    trained = int(llama_cpp.llama_model_n_ctx_train(llm.model))
    if trained and n_ctx > trained:
        return load_llama(gguf, trained, n_threads)
    return llm


class LlamaCppBackend(ChainBackend):
    """A GGUF model run by llama.cpp: chains only, logits for every fed token."""

    kind = "llamacpp"
    runtime = "llama.cpp"
    # Measured on the Q4_K_M target: the top-2 gap of a token moves by up to 0.27 logits
    # between its single-token pass and a block (docs/cost-profile.md); 0.5 bounds it.
    tie_tolerance = 0.5

    def __init__(
        self, gguf: str | Path, n_threads: int, name: str = "llamacpp", n_ctx: int = DEFAULT_CONTEXT
    ) -> None:
        self.llm = load_llama(gguf, n_ctx, n_threads)
        import llama_cpp

        self.name = name
        self.vocab_size = int(self.llm.n_vocab())
        self.max_context = int(self.llm.n_ctx())
        self.hidden_size = int(llama_cpp.llama_model_n_embd(self.llm.model))
        self.num_layers = int(llama_cpp.llama_model_n_layer(self.llm.model))
        self.bytes_per_forward = int(llama_cpp.llama_model_size(self.llm.model))
        self._len = 0

    def _feed(self, ids: list[int], every_row: bool) -> torch.Tensor:
        """In batches of n_batch, each row copied out at once (the next decode overwrites
        llama.cpp's buffer)."""
        import numpy as np

        ctx, batch, step = self.llm._ctx, self.llm._batch, self.llm.n_batch
        rows = []
        for start in range(0, len(ids), step):
            chunk = ids[start : start + step]
            batch.set_batch(batch=chunk, n_past=self._len, logits_all=every_row)
            ctx.decode(batch)
            self._len += len(chunk)
            if every_row:
                shape = (len(chunk), self.vocab_size)
                rows.append(torch.from_numpy(np.ctypeslib.as_array(ctx.get_logits(), shape).copy()))
        if not every_row and ids:
            last = np.ctypeslib.as_array(ctx.get_logits_ith(-1), shape=(1, self.vocab_size))
            rows.append(torch.from_numpy(last.copy()))
        return torch.cat(rows) if rows else torch.empty(0, self.vocab_size)

    def _remove_from(self, length: int) -> None:
        self.llm._ctx.kv_cache_seq_rm(-1, length, -1)
