"""The GGUF file behind a model, which both llama.cpp runtimes (llama.cpp through
llama-cpp-python, `llamacpp/`, and ik_llama.cpp, `ik/`) run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from adaspec.errors import AdaspecError


class LlamaCppUnavailable(AdaspecError):
    """llama.cpp cannot run here (extra not installed, or no GGUF file for the model)."""


def gguf_file(model: str) -> Path | None:
    """The verified GGUF file behind a model: a built-in model's assembled file (checked
    against the registry's size and sha256, assembled first if needed) or a .gguf path;
    None for a Hugging Face directory (no GGUF)."""
    from adaspec.store.assembly import assemble, check_gguf_magic
    from adaspec.store.catalog import model_catalog

    if model in model_catalog():
        return assemble(model)
    path = Path(model).expanduser()
    if not path.is_file():
        return None
    check_gguf_magic(path)
    return path.resolve()


def checked_gguf(model: str, ready: Callable[[], object]) -> Path:
    """The verified GGUF file a llama.cpp runtime runs for a built-in model or .gguf path,
    or the runtime's own error (`ready` raises it: the package missing) or
    LlamaCppUnavailable (no GGUF behind the model)."""
    ready()  # a missing runtime is reported before any file work
    path = gguf_file(model)
    if path is None:
        raise LlamaCppUnavailable(
            f"{model} has no GGUF file for llama.cpp (a Hugging Face directory); use a "
            "built-in model name or a .gguf path"
        )
    return path


def gguf_backend_args(
    model: str, n_threads: int, n_ctx: int, ready: Callable[[], object]
) -> tuple[Path, int, str, int]:
    """The arguments of `LlamaCppBackend` or `IkLlamaBackend` for a built-in model or .gguf
    path (`ready`: the runtime's check that it can run, `checked_gguf`): the checked file,
    named as the torch loader names the same source (artifacts compare these names). In this
    process or a child's, the backend is built from these."""
    from adaspec.store.loading import source_name

    return checked_gguf(model, ready), n_threads, source_name(model), n_ctx
