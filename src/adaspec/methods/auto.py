"""`auto`: cost-aware drafting, the default method (draft/auto.py)."""

from __future__ import annotations

from dataclasses import dataclass

from adaspec.errors import InputError
from adaspec.methods.base import Method, Models
from adaspec.methods.head import check_weights
from adaspec.methods.params import check, param

SOURCES = ("ngram", "history", "draft", "head")
# the head where one ships for the target and the runtime returns the target's features
# (experiments/results/head-disco-xeon-amx: with the head 1.34x ar in process against 1.26x,
# 31.1 tokens/s at 8 clients against 27.7); quietly left out elsewhere
DEFAULT_USE = "ngram+history+draft+head"


@dataclass(frozen=True)
class AutoParams:
    use: str = param(
        DEFAULT_USE,
        "what a step may propose besides nothing, joined by +: ngram (this request), history "
        "(earlier requests), draft (the draft model), head (the draft head over the target's "
        "features, docs/head.md; in the default only where one ships for the target and the "
        "runtime returns the features)",
    )
    head: str = param("", "the draft head's file (default: the one shipped for the target)")
    head_weights: str = param("default", "the head's weights at run time: default (ggml "
                              "where the target runs in ik_llama.cpp, else int8) | fp32 | bf16 "
                              "| int8 (int8 rows, bf16 activations) | int8-dyn | ggml")
    head_ms: float = param(0.0, "ms a head step is priced at, fixed (0: timed when the engine "
                           "is built, then learned from the steps it runs)")
    k_max: int = param(16, "most tokens one step may propose")
    n_max: int = param(4, "longest n-gram to match")
    n_min: int = param(1, "shortest n-gram to match")
    profile: str = param(
        "",
        "cost profile: a JSON file, or 'flat' (simulated GPU-like costs), priced as it is; "
        "default: this machine's, measured on first use and cached, its prices then "
        "rescaled by what the target's calls take as the method runs (cost/live.py)",
    )
    disco: str = param(
        "",
        "a DISCO artifact (adaspec disco tune): its classifier estimates draft tokens' "
        "acceptance (default: running per-confidence-bucket rates)",
    )
    verify: str = param(
        "default",
        "verifier: default (greedy at T=0, speculative above; mcss-wor with tree=priced) | "
        "greedy | speculative | mcss | mcss-wor | mcns",
    )
    tree: str = param(
        "",
        "priced: a greedy step drafting from the head proposes the head's chain with its next "
        "candidates beside its tokens (a token tree), kept where the cost profile pays for "
        "their rows: rarely on a CPU, often where rows are nearly free (a GPU); needs head in "
        "use=; chains only for constrained output (docs/mcsd.md)",
    )

    def __post_init__(self) -> None:
        from adaspec.verify import check_verifier_name

        use = self.sources
        check(bool(use) and all(u in SOURCES for u in use) and len(set(use)) == len(use),
              "use must be ngram, history, draft or head, or several joined by + "
              "(e.g. ngram+history+head)")
        check(self.k_max >= 1, "k_max must be >= 1")
        check(self.head_ms >= 0, "head_ms must be >= 0")
        check_weights(self.head_weights)
        check(1 <= self.n_min <= self.n_max, "need 1 <= n_min <= n_max")
        check_verifier_name(self.verify)
        check(self.tree in ("", "priced"), "tree must be priced (or left unset: chains)")
        if self.tree and "head" not in use:
            raise InputError("tree=priced shapes the draft head's trees; it needs head in use= "
                             "(e.g. use=ngram+history+head)")
        if self.disco and "draft" not in use:
            raise InputError("disco= estimates draft-model tokens; it needs draft in use= "
                             "(e.g. use=ngram+draft)")

    @property
    def sources(self) -> list[str]:
        return self.use.split("+")


def _build(params: AutoParams, models: Models, text: str):
    from adaspec.control.static import StaticLength
    from adaspec.draft.auto import AutoDrafter
    from adaspec.draft.model import ModelDrafter
    from adaspec.engine.loop import Engine, tokenizer_eos_ids

    use = params.sources
    if "draft" in use and models.draft is None:
        raise InputError(f"method {text!r} needs a draft model (--draft), or use=ngram")
    model = ModelDrafter(models.draft) if "draft" in use and models.draft is not None else None
    profile = models.cost_profile(params.profile, with_draft=model is not None)
    disco = None
    if params.disco:
        from adaspec.control.disco_artifact import DiscoArtifact

        disco = DiscoArtifact.load(params.disco)
        assert models.draft is not None  # disco= needs use=draft, checked above
        disco.check_pair(models.target.name, models.draft.name)
    history = None
    if "history" in use:
        # the one a server shares between its engines (and saves), else this engine's own
        history = models.history
        if history is None:
            from adaspec.draft.history import HistoryIndex

            history = HistoryIndex(models.target.vocab_size)
    head, head_ms = _head(params, models)
    eos = (models.eos_token_ids if models.eos_token_ids is not None
           else tokenizer_eos_ids(models.tokenizer))
    drafter = AutoDrafter(profile, model, disco=disco, n_max=params.n_max, n_min=params.n_min,
                          k_max=params.k_max, use_ngram="ngram" in use, history=history,
                          head=head, head_ms=head_ms, learn_head_ms=not params.head_ms,
                          # the machine's own profile, not a file's or one handed in
                          learn_prices=not params.profile and models.profile is None,
                          eos_token_ids=set(eos),  # what ends an output the history learns
                          trees=params.tree == "priced")
    engine = Engine(
        models.target,
        models.tokenizer,
        drafter=drafter,
        controller=StaticLength(params.k_max),  # the drafter prices every length itself
        verify=params.verify,
        eos_token_ids=eos,
    )
    return engine


def _head(params: AutoParams, models: Models):
    """The draft head where `use` names it: (drafter, ms a step) or (None, 0); a missing head
    or a runtime without the target's features is an error naming what to do."""
    if "head" not in params.sources:
        if params.head:
            raise InputError("head= names a draft head; add head to use= (e.g. "
                             "use=ngram+history+head)")
        return None, 0.0
    from adaspec.draft.head_artifact import builtin_for

    target = models.target
    path = params.head or builtin_for(target.name)
    if params.use == DEFAULT_USE and not params.head:  # not asked for: only where it can run
        from adaspec.store.loading import cache_dir_for

        if not target.has_features or path is None or not (
                getattr(target, "model", None) is not None
                or (cache_dir_for(target.name) / "model.safetensors").is_file()):
            return None, 0.0
    if not target.has_features or path is None:
        if not target.has_features:
            raise InputError(f"use=head reads the target's hidden states, which runtime "
                             f"{target.kind} does not return (torch, or ik_llama.cpp built with "
                             f"its features patch: adaspec runtime build)")
        raise InputError(f"no draft head ships for {target.name}: adaspec head data, then "
                         f"adaspec head train, then head=PATH")
    from pathlib import Path

    from adaspec.draft.head_ggml import load_drafter

    if params.head and not Path(params.head).expanduser().is_file():
        raise InputError(f"draft head not found: {params.head}")
    drafter = load_drafter(Path(path).expanduser(), target, params.head_weights)
    return drafter, params.head_ms or drafter.step_ms()


def _parameters(params: AutoParams, target_name: str, draft_params: int | None) -> int:
    """The most a drafted token runs through among its sources (n-grams and the history:
    none; the head: its own; the draft model: its)."""
    from adaspec.methods.head import head_parameters

    counts = [0]
    if "head" in params.sources:
        counts.append(head_parameters(params.head, target_name))
    if "draft" in params.sources:
        if draft_params is None:
            raise InputError("auto with the draft model in use= needs a draft model")
        counts.append(draft_params)
    return max(counts)


METHOD = Method(
    "auto",
    "cost-aware: each step proposes nothing, an n-gram, a history (earlier requests), a "
    "draft-model or (use=...+head) a draft-head continuation, whichever gives the most "
    "expected tokens per second under this machine's cost profile",
    AutoParams,
    _build,
    needs_draft=lambda params: "draft" in params.sources,
    own_parameters=_parameters,
    doc="docs/auto.md",
)
