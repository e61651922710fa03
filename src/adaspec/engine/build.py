"""Assemble an Engine from a method string and loaded models.

Models load once; `build_engine` is cheap, so the bench can switch methods on the same
loaded target and draft.
"""

from __future__ import annotations

from collections.abc import Callable

from adaspec.backends.base import ModelBackend
from adaspec.backends.restricted_head import with_stored_vocab
from adaspec.cost.profile import CostProfile
from adaspec.draft.auto import AutoDrafter
from adaspec.draft.model import ModelDrafter
from adaspec.draft.model_tree import AutoTreeDrafter, ModelTreeDrafter
from adaspec.draft.ngram import NgramDrafter
from adaspec.engine.loop import Engine
from adaspec.engine.token_tree import AutoBranching
from adaspec.errors import InputError
from adaspec.methods.spec import DEFAULT_METHOD, MethodSpec, build_controller, parse_method
from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT
from adaspec.verify import get_verifier
from adaspec.verify.multi_candidate import get_tree_verifier

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


def build_engine(
    method: str | MethodSpec,
    target: ModelBackend,
    tokenizer,
    draft: ModelBackend | None = None,
    eos_token_ids: list[int] | None = None,
    profile: CostProfile | None = None,
) -> Engine:
    """The engine of a method on loaded models. `profile` prices the steps of cost-aware
    methods (`auto`, DISCO's stop=cost, tree=auto); by default, the method's profile=...,
    else this machine's profile of these models (measured on first use, then cached)."""
    spec = parse_method(method) if isinstance(method, str) else method
    if spec.name == "router":
        from adaspec.route.router import router_from_artifact

        if not target.has_hidden_states:
            raise InputError(
                f"method {spec.text!r} reads the target's hidden state, which its backend "
                f"({type(target).__name__}) does not give; run the router on torch weights"
            )

        return router_from_artifact(
            str(spec["artifact"]), target, tokenizer, draft, eos_token_ids,
            mode=str(spec["mode"]), seed=int(spec["seed"]),  # type: ignore[call-overload]
        )
    drafter = None
    if spec.tree is not None:
        for role, backend in (("target", target), ("draft", draft)):
            if backend is not None and not backend.supports_trees:
                raise InputError(
                    f"method {spec.text!r} needs token trees, which the {role}'s backend "
                    f"({type(backend).__name__}) does not score; run it on torch weights"
                )
    if spec.name == "draft":
        if draft is None:
            raise InputError(f"method {spec.text!r} needs a draft model (--draft)")
        draft = with_stored_vocab(draft, int(spec["vocab"]))  # type: ignore[call-overload]
        tree = spec.tree
        cost_rule = spec["ctrl"] == "disco" and spec["stop"] == "cost"
        if cost_rule or isinstance(tree, AutoBranching):  # priced on this machine's costs
            profile = _method_profile(spec, target, tokenizer, draft, profile)
        if tree is None:
            drafter = ModelDrafter(draft)
        elif isinstance(tree, AutoBranching):
            drafter = AutoTreeDrafter(draft, profile, tree.max_nodes)  # type: ignore[arg-type]
        else:
            drafter = ModelTreeDrafter(draft, tree)
    elif spec.name == "ngram":
        drafter = NgramDrafter(n_max=int(spec["n_max"]), n_min=int(spec["n_min"]))  # type: ignore[call-overload]
    elif spec.name == "auto":
        drafter = _auto_drafter(spec, target, tokenizer, draft, profile)
    verify = spec.params.get("verify", "auto")
    if verify == "auto":
        verifier = None
    elif spec.params.get("tree"):
        verifier = get_tree_verifier(str(verify))
    else:
        verifier = get_verifier(str(verify))
    controller = build_controller(spec, profile)
    check_models = getattr(controller, "check_models", None)  # a trained controller (DISCO)
    if check_models is not None and draft is not None:
        check_models(target.name, draft.name)
    return Engine(
        target,
        tokenizer,
        drafter=drafter,
        controller=controller,
        verifier=verifier,
        eos_token_ids=eos_token_ids,
    )


def _method_profile(
    spec: MethodSpec,
    target: ModelBackend,
    tokenizer,
    draft: ModelBackend,
    profile: CostProfile | None,
) -> CostProfile:
    """The cost profile of DISCO's stop=cost and tree=auto: the caller's, else the method's
    profile=..., else this machine's for these backends (measured once, then cached)."""
    if profile is not None:
        return profile
    from adaspec.cost.cache import profile_for
    from adaspec.cost.profile import load_profile

    if spec["profile"]:
        return load_profile(str(spec["profile"]))
    return profile_for(target, draft, tokenizer)


def _auto_drafter(
    spec: MethodSpec,
    target: ModelBackend,
    tokenizer,
    draft: ModelBackend | None,
    profile: CostProfile | None,
) -> AutoDrafter:
    from adaspec.cost.cache import profile_for
    from adaspec.cost.profile import load_profile

    use = str(spec["use"]).split("+")
    if "draft" in use and draft is None:
        raise InputError(f"method {spec.text!r} needs a draft model (--draft), or use=ngram")
    model = ModelDrafter(draft) if "draft" in use and draft is not None else None
    if profile is None:
        if spec["profile"]:
            profile = load_profile(str(spec["profile"]))
        else:
            profile = profile_for(target, draft if model is not None else None, tokenizer)
    disco = None
    if spec["disco"]:
        from adaspec.control.disco_artifact import DiscoArtifact

        if model is None:
            raise InputError(f"method {spec.text!r}: disco= estimates draft-model tokens; "
                             "it needs use=draft or use=ngram+draft")
        disco = DiscoArtifact.load(str(spec["disco"]))
        disco.check_pair(target.name, draft.name)  # type: ignore[union-attr]
    return AutoDrafter(
        profile,
        model,
        disco=disco,
        n_max=int(spec["n_max"]),  # type: ignore[call-overload]
        n_min=int(spec["n_min"]),  # type: ignore[call-overload]
        k_max=int(spec["k_max"]),  # type: ignore[call-overload]
        use_ngram="ngram" in use,
    )


def load_backends(
    target: str = TARGET_DEFAULT,
    draft: str | None = DRAFT_DEFAULT,
    dtype: str = "bfloat16",
    quant: str = "auto",
    draft_quant: str = "auto",
) -> tuple[ModelBackend, object, ModelBackend | None, list[int]]:
    """Load the target (and draft), each with its own weights (`auto`: the fastest runtime
    this machine has); the draft's tokenizer must match the target's. Models that run in
    child processes load at the same time. Returns (target, tokenizer, draft or None, EOS
    ids)."""
    from adaspec.store.model_store import check_tokenizer_pair

    finish_target = start_backend(target, dtype, quant, role="target")
    finish_draft = None
    if draft:
        finish_draft = start_backend(draft, dtype, draft_quant, role="draft",
                                     tokenizer_like=target)
    tgt, tokenizer, eos = finish_target()
    draft_backend = None
    if finish_draft is not None:
        draft_backend, draft_tokenizer, _ = finish_draft()
        if draft_tokenizer is not None:  # None: the same tokenizer files as the target's
            check_tokenizer_pair(tokenizer, draft_tokenizer, target, draft)
    return tgt, tokenizer, draft_backend, eos


Loaded = tuple[ModelBackend, object, list[int]]


def load_backend(
    name: str, dtype: str = "bfloat16", quant: str = "auto", role: str = "target"
) -> Loaded:
    """One model as a backend, with its tokenizer and EOS ids (see `start_backend`)."""
    return start_backend(name, dtype, quant, role)()


def start_backend(
    name: str,
    dtype: str = "bfloat16",
    quant: str = "auto",
    role: str = "target",
    tokenizer_like: str | None = None,
) -> Callable[[], Loaded]:
    """Start loading one model; the returned function finishes it: (backend, tokenizer, EOS
    ids). With `tokenizer_like` (another model) the tokenizer of a runtime that does not need
    one is not loaded when both carry the same tokenizer files: it comes back as None.

    quant `ik` / `gguf` run the model's GGUF with ik_llama.cpp / llama.cpp (the tokenizer
    still comes from the verified cache) in a child process of its own, started here so
    several load at once: beside torch in one process the two thread pools slow each other
    down about 2x, and a native abort in the child is a one-line error. `auto` is the
    fastest runtime installed (models/weights.py). Otherwise it is a torch model with that
    weight quantization; a quantized target (row-independent Linear layers) gets
    row-invariant attention, so verifying a block scores bit-for-bit what plain decoding
    scores. A float target's batched GEMMs are not row-invariant anyway: it keeps the faster
    batched attention and the exactness check's tie rule, as does every draft and a model
    with sliding-window layers (not handled by the row-invariant path)."""
    from adaspec.backends.ikllama import IK, IkLlamaBackend
    from adaspec.backends.llamacpp import GGUF, LlamaCppBackend, gguf_backend_args
    from adaspec.backends.weights import AUTO, best_weights, llama_threads
    from adaspec.store.loading import same_vocabulary_files, tokenizer_dir
    from adaspec.store.model_store import load_tokenizer

    if quant == AUTO:
        quant = best_weights(name)
    if quant in (GGUF, IK):
        from adaspec.backends.process_backend import ProcessBackend

        # fails fast (package missing, no GGUF), before a child process starts
        args = gguf_backend_args(name, llama_threads(), runtime=quant)
        backend = ProcessBackend(IkLlamaBackend if quant == IK else LlamaCppBackend, *args,
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
    return lambda: _load_torch_backend(name, dtype, quant, role)


def _load_torch_backend(name: str, dtype: str, quant: str, role: str) -> Loaded:
    from adaspec.backends.attention import row_invariance_supported
    from adaspec.backends.torch_backend import TorchBackend
    from adaspec.store.model_store import load_model

    loaded = load_model(name, dtype=dtype, quant=quant)
    invariant = (role == "target" and loaded.quant != "none"
                 and row_invariance_supported(loaded.model))
    backend = TorchBackend(loaded.model, name=loaded.name, row_invariant=invariant)
    return backend, loaded.tokenizer, eos_ids_of(loaded.model, loaded.tokenizer)


def load_engine(
    method: str = DEFAULT_METHOD,
    target: str = TARGET_DEFAULT,
    draft: str | None = DRAFT_DEFAULT,
    dtype: str = "bfloat16",
    quant: str = "auto",
    draft_quant: str = "auto",
) -> Engine:
    """Load the models a method needs (from the verified cache, quantized as asked) and build
    its engine."""
    spec = parse_method(method)
    if spec.needs_draft_model and draft is None:
        raise InputError(f"method {spec.text!r} needs a draft model (--draft)")
    tgt, tokenizer, drf, eos = load_backends(  # a method's own `@int8/int4` wins
        target, draft if spec.needs_draft_model else None, dtype, spec.quant or quant,
        spec.draft_quant or draft_quant,
    )
    return build_engine(spec, tgt, tokenizer, drf, eos_token_ids=eos)
