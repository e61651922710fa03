"""`draft`: the draft model proposes tokens, as a chain (k tokens, any length controller) or
as a token tree (tree=4x2x2x1, or tree=priced: the shape with the most expected tokens per ms
under the cost profile)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from adaspec.control.confidence import HF_DEFAULT_THRESHOLD
from adaspec.control.disco import GUESSES, STOP_RULES
from adaspec.core.token_tree import DEFAULT_MAX_NODES, PricedBranching, parse_branching
from adaspec.errors import InputError
from adaspec.methods.base import Method, Models
from adaspec.methods.params import ChainParams, check, param

if TYPE_CHECKING:
    from adaspec.control import LengthSettings
    from adaspec.draft.base import Drafter


@dataclass(frozen=True)
class DraftParams(ChainParams):
    tree: str = param(
        "",
        "token tree, candidates per level, e.g. 4x2x2x1, or priced (each step the chain or "
        "tree with the most expected tokens per ms under the cost profile, from the "
        "request's acceptance per candidate rank) (unset: a chain of k)",
    )
    max_nodes: int = param(DEFAULT_MAX_NODES, "limit on the drafted nodes of a tree")
    threshold: float = param(
        -1.0,
        "ctrl=confidence: stop below this top draft probability (default "
        f"{HF_DEFAULT_THRESHOLD}, as Hugging Face; k bounds the draft); ctrl=disco: tau, "
        "stop below this acceptance probability (default: the artifact's tuned tau)",
    )
    disco: str = param("", "ctrl=disco: the artifact file from `adaspec disco tune` (default: "
                           "the classifier shipped for the built-in pair)")
    sl_max: int = param(
        0,
        "ctrl=disco: most tokens per draft (0: the artifact's tuned SL_max, for stop=cost the "
        "cap tuned for it, else 8)",
    )
    stop: str = param(
        "tau",
        "ctrl=disco: tau (stop below the threshold, the paper's rule) | cost (draft another "
        "token while it raises the step's expected tokens per ms under the cost profile)",
    )
    guess: str = param(
        "",
        "ctrl=disco,stop=cost: the next token's acceptance, unknown before it is drafted: last "
        "(the last probability) | mean (the request's running mean); default: the artifact's "
        "tuned one, else last",
    )
    profile: str = param(
        "",
        "cost profile of stop=cost and tree=priced: a JSON file, 'flat' or 'linear:...'; "
        "default: this machine's, measured on first use and cached",
    )
    vocab: int = param(
        0,
        "draft head keeps only the N most frequent target tokens (0: full head; the set "
        "comes from `adaspec models restrict-vocab --top N`)",
    )

    def __post_init__(self) -> None:
        from adaspec import verify

        super().__post_init__()
        check(self.vocab >= 0, "vocab must be >= 0 (0 keeps the full head)")
        check(self.stop in STOP_RULES, f"stop must be one of {STOP_RULES}")
        check(not self.guess or self.guess in GUESSES, f"guess must be one of {GUESSES}")
        if self.ctrl != "disco" and (self.stop != "tau" or self.guess):
            raise InputError("stop and guess are ctrl=disco's settings")
        if self.stop == "cost" and self.threshold >= 0:
            raise InputError("threshold is tau, the stop=tau rule's; stop=cost has none")
        tree = self.branching  # parses: a bad shape raises here
        if self.profile and self.stop != "cost" and not isinstance(tree, PricedBranching):
            raise InputError("profile prices stop=cost and tree=priced only; the other "
                             "settings do not read costs")
        if tree is not None and self.ctrl != "static":
            raise InputError(f"a token tree has a fixed shape; ctrl={self.ctrl} only works "
                             "with chains")
        verify.choose(self.verify, trees=tree is not None)

    def length_settings(self) -> LengthSettings:
        """ctrl=confidence's threshold or DISCO's settings beside k (threshold is tau for
        DISCO's stop=tau)."""
        from adaspec.control import DiscoSettings, LengthSettings

        threshold = self.threshold if self.threshold >= 0 else None
        if self.ctrl != "disco":
            return LengthSettings(self.k, max(self.k, self.k_max), threshold)
        disco = DiscoSettings(self.disco, tau=threshold, sl_max=self.sl_max or None,
                              stop=self.stop, guess=self.guess or None)
        return LengthSettings(self.k, max(self.k, self.k_max), disco=disco)

    @property
    def branching(self) -> tuple[int, ...] | None:
        """The tree's branching factors per level (PricedBranching for tree=priced), or
        None."""
        return parse_branching(self.tree, self.max_nodes) if self.tree else None

    @property
    def prices_steps(self) -> bool:
        """Reads the cost profile: DISCO's cost rule or tree=priced."""
        return (self.ctrl == "disco" and self.stop == "cost") or isinstance(
            self.branching, PricedBranching
        )


def _build(params: DraftParams, models: Models, text: str):
    from adaspec.backends.torch.restricted_head import with_stored_vocab
    from adaspec.control import CONTROLLERS
    from adaspec.control.static import StaticLength
    from adaspec.draft.model import ModelDrafter
    from adaspec.draft.model_tree import ModelTreeDrafter, PricedTreeDrafter
    from adaspec.engine.loop import Engine

    if models.draft is None:
        raise InputError(f"method {text!r} needs a draft model (--draft)")
    tree = params.branching
    if tree is not None:
        for role, backend in (("target", models.target), ("draft", models.draft)):
            if not backend.supports_trees:
                raise InputError(
                    f"method {text!r} needs token trees, which the {role}'s backend "
                    f"({type(backend).__name__}) does not score; run it on torch weights"
                )
    draft = with_stored_vocab(models.draft, params.vocab)
    profile = models.cost_profile(params.profile) if params.prices_steps else None
    drafter: Drafter
    if tree is None:
        drafter = ModelDrafter(draft)
        controller = CONTROLLERS[params.ctrl].build(params.length_settings(), profile)
    elif isinstance(tree, PricedBranching):
        assert profile is not None  # tree=priced prices its steps
        drafter = PricedTreeDrafter(draft, profile, tree.max_nodes)
        controller = StaticLength(tree.max_depth)  # the drafter picks a shape this deep
    else:
        drafter = ModelTreeDrafter(draft, tree)
        controller = StaticLength(len(tree))  # a fixed shape: the bound is its depth
    check_models = getattr(controller, "check_models", None)  # a trained controller (DISCO)
    if check_models is not None:
        check_models(models.target.name, draft.name)
    return Engine(
        models.target,
        models.tokenizer,
        drafter=drafter,
        controller=controller,
        verify=params.verify,
        eos_token_ids=models.eos_token_ids,
    )


METHOD = Method(
    "draft",
    "the draft model proposes tokens autoregressively: a chain of k, or a token tree "
    "(tree=4x2x2x1 or priced; [mcsd.md](docs/mcsd.md))",
    DraftParams,
    _build,
    needs_draft=lambda params: True,
    doc="docs/draft.md",
)
