"""Load models as backends on a device: the runtime the registry gives for the weights
(backends/runtimes.py; `fastest` picks one), several at once; their tokenizers and
end-of-sequence ids."""

from __future__ import annotations

from collections.abc import Callable

from adaspec.backends.base import Loaded, ModelBackend
from adaspec.backends.device import AUTO, CPU, resolve_device
from adaspec.backends.weights import FASTEST
from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT


def load_backends(
    target: str = TARGET_DEFAULT,
    draft: str | None = DRAFT_DEFAULT,
    dtype: str = "bfloat16",
    weights: str = FASTEST,
    draft_weights: str = FASTEST,
    sequences: int = 1,
    device: str = AUTO,
) -> tuple[ModelBackend, object, ModelBackend | None, list[int]]:
    """Load the target (and draft), each with its own weights (`fastest`: the fastest runtime
    this machine has); the draft's tokenizer must match the target's. Models that run in
    child processes load at the same time. Returns (target, tokenizer, draft or None, EOS
    ids). sequences: how many sequences a multi-sequence runtime holds (a server decoding
    requests together: its batch, plus the runtime's own). device: where they run
    (backends/device.py: `auto` is a CUDA GPU where torch sees one)."""
    from adaspec.store.model_store import check_tokenizer_pair

    device = resolve_device(device)
    finish_target = start_backend(target, dtype, weights, role="target", sequences=sequences,
                                  device=device)
    finish_draft = None
    if draft:
        finish_draft = start_backend(draft, dtype, draft_weights, role="draft",
                                     tokenizer_like=target, sequences=sequences, device=device)
    tgt, tokenizer, eos = finish_target()
    draft_backend = None
    if finish_draft is not None:
        draft_backend, draft_tokenizer, _ = finish_draft()
        if draft_tokenizer is not None:  # None: the same tokenizer files as the target's
            assert draft is not None  # finish_draft exists only for a draft
            check_tokenizer_pair(tokenizer, draft_tokenizer, target, draft)
    return tgt, tokenizer, draft_backend, eos


def load_backend(
    name: str, dtype: str = "bfloat16", weights: str = FASTEST, role: str = "target",
    device: str = AUTO,
) -> Loaded:
    """One model as a backend, with its tokenizer and EOS ids (see `start_backend`)."""
    return start_backend(name, dtype, weights, role, device=resolve_device(device))()


def start_backend(
    name: str,
    dtype: str = "bfloat16",
    weights: str = FASTEST,
    role: str = "target",
    tokenizer_like: str | None = None,
    sequences: int = 1,
    device: str = CPU,
) -> Callable[[], Loaded]:
    """Start loading one model; the returned function finishes it: (backend, tokenizer, EOS
    ids). With `tokenizer_like` (another model) the tokenizer of a runtime that does not need
    one is not loaded when both carry the same tokenizer files: it comes back as None.

    The runtime comes from the registry (backends/runtimes.py) by weights and device:
    `ik` / `gguf` run the model's GGUF with ik_llama.cpp / llama.cpp in a child process of
    its own, `fastest` is the fastest runtime installed for the device. Otherwise it is a
    torch model with that weight quantization; a quantized target (row-independent Linear
    layers) gets row-invariant attention, so verifying a block scores bit-for-bit what
    plain decoding scores. A float target's batched GEMMs are not row-invariant anyway: it
    keeps the faster batched attention and the exactness check's tie rule, as does every
    draft and a model with sliding-window layers (not handled by the row-invariant path).
    On `cuda` (a resolved device) only torch in the model's dtype runs."""
    from adaspec.backends.base import LoadRequest
    from adaspec.backends.runtimes import fastest_weights, runtime_for
    from adaspec.backends.weights import check_weights

    if check_weights(weights) == FASTEST:
        weights = fastest_weights(name, device)
    runtime = runtime_for(weights, device)
    return runtime.begin_load(LoadRequest(name, dtype, weights, role, device, tokenizer_like,
                                     sequences))
