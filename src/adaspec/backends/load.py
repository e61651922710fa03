"""Load models as backends: the runtime `fastest` picks (backends/weights.py), torch or a
llama.cpp runtime in a child process, several at once; their tokenizers and end-of-sequence
ids."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adaspec.backends.base import ModelBackend
from adaspec.backends.weights import FASTEST
from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT

END_MARKERS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>")


def eos_ids_of(model, tokenizer) -> list[int]:
    """EOS ids from the generation config (Qwen instruct stops on <|im_end|> and
    <|endoftext|>) and the tokenizer."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        # GGUF conversions often list only the chat end marker; plain end-of-text ends too.
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        ids.update(vocab[t] for t in END_MARKERS if t in vocab)
    return sorted(ids)


def load_backends(
    target: str = TARGET_DEFAULT,
    draft: str | None = DRAFT_DEFAULT,
    dtype: str = "bfloat16",
    weights: str = FASTEST,
    draft_weights: str = FASTEST,
    sequences: int = 1,
) -> tuple[ModelBackend, object, ModelBackend | None, list[int]]:
    """Load the target (and draft), each with its own weights (`fastest`: the fastest runtime
    this machine has); the draft's tokenizer must match the target's. Models that run in
    child processes load at the same time. Returns (target, tokenizer, draft or None, EOS
    ids). sequences: how many sequences a multi-sequence runtime holds (a server decoding
    requests together: its batch, plus the runtime's own)."""
    from adaspec.store.model_store import check_tokenizer_pair

    finish_target = start_backend(target, dtype, weights, role="target", sequences=sequences)
    finish_draft = None
    if draft:
        finish_draft = start_backend(draft, dtype, draft_weights, role="draft",
                                     tokenizer_like=target, sequences=sequences)
    tgt, tokenizer, eos = finish_target()
    draft_backend = None
    if finish_draft is not None:
        draft_backend, draft_tokenizer, _ = finish_draft()
        if draft_tokenizer is not None:  # None: the same tokenizer files as the target's
            assert draft is not None  # finish_draft exists only for a draft
            check_tokenizer_pair(tokenizer, draft_tokenizer, target, draft)
    return tgt, tokenizer, draft_backend, eos


Loaded = tuple[ModelBackend, object, list[int]]


def load_backend(
    name: str, dtype: str = "bfloat16", weights: str = FASTEST, role: str = "target"
) -> Loaded:
    """One model as a backend, with its tokenizer and EOS ids (see `start_backend`)."""
    return start_backend(name, dtype, weights, role)()


def start_backend(
    name: str,
    dtype: str = "bfloat16",
    weights: str = FASTEST,
    role: str = "target",
    tokenizer_like: str | None = None,
    sequences: int = 1,
) -> Callable[[], Loaded]:
    """Start loading one model; the returned function finishes it: (backend, tokenizer, EOS
    ids). With `tokenizer_like` (another model) the tokenizer of a runtime that does not need
    one is not loaded when both carry the same tokenizer files: it comes back as None.

    weights `ik` / `gguf` run the model's GGUF with ik_llama.cpp / llama.cpp (the tokenizer
    still comes from the verified cache) in a child process of its own, started here so
    several load at once: beside torch in one process the two thread pools slow each other
    down about 2x, and a native abort in the child is a one-line error. `fastest` is the
    fastest runtime installed (backends/weights.py). Otherwise it is a torch model with that
    weight quantization; a quantized target (row-independent Linear layers) gets
    row-invariant attention, so verifying a block scores bit-for-bit what plain decoding
    scores. A float target's batched GEMMs are not row-invariant anyway: it keeps the faster
    batched attention and the exactness check's tie rule, as does every draft and a model
    with sliding-window layers (not handled by the row-invariant path)."""
    from adaspec.backends.ikllama import IK, IkLlamaBackend, context_for, target_min_rows
    from adaspec.backends.llamacpp import GGUF, LlamaCppBackend, gguf_backend_args
    from adaspec.backends.weights import best_weights, check_weights, llama_threads
    from adaspec.store.loading import same_vocabulary_files, tokenizer_dir
    from adaspec.store.model_store import load_tokenizer

    if check_weights(weights) == FASTEST:
        weights = best_weights(name)
    if weights in (GGUF, IK):
        from adaspec.backends.process_backend import ProcessBackend

        # fails fast (package missing, no GGUF), before a child process starts
        args: tuple[Any, ...] = gguf_backend_args(name, llama_threads(), runtime=weights)
        if weights == IK:  # repacked; a target's blocks decided at load (exact greedy)
            args = (*gguf_backend_args(name, llama_threads(), context_for(sequences), IK),
                    True, target_min_rows() if role == "target" else 1, sequences)
        backend = ProcessBackend(IkLlamaBackend if weights == IK else LlamaCppBackend, *args,
                                 wait=False)

        def finish() -> Loaded:
            try:
                tokenizer = None
                if tokenizer_like is None or not same_vocabulary_files(
                    tokenizer_dir(name, dtype), tokenizer_dir(tokenizer_like, dtype)
                ):
                    tokenizer = load_tokenizer(name, dtype)
                backend.ready()
            except BaseException:
                backend.close()
                raise
            return backend, tokenizer, eos_ids_of(None, tokenizer) if tokenizer else []

        return finish
    return lambda: _load_torch_backend(name, dtype, weights, role)


def _load_torch_backend(name: str, dtype: str, quant: str, role: str) -> Loaded:
    """A torch model with weight quantization `quant` (store/quant.py)."""
    from adaspec.backends.attention import row_invariance_supported
    from adaspec.backends.torch_backend import TorchBackend
    from adaspec.store.model_store import load_model

    loaded = load_model(name, dtype=dtype, quant=quant)
    invariant = (role == "target" and loaded.quant != "none"
                 and row_invariance_supported(loaded.model))
    backend = TorchBackend(loaded.model, name=loaded.name, row_invariant=invariant)
    return backend, loaded.tokenizer, eos_ids_of(loaded.model, loaded.tokenizer)


