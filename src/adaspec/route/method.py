"""`router`: a trained policy picks one of its arms (methods) per request (route/)."""

from __future__ import annotations

from dataclasses import dataclass

from adaspec.errors import InputError
from adaspec.methods.params import check, param
from adaspec.methods.registry import Method, Models
from adaspec.route.policy import MODES


@dataclass(frozen=True)
class RouterParams:
    artifact: str = param("", "trained router (adaspec router train); router:PATH is short "
                              "(default: the policy shipped for the built-in pair)")
    mode: str = param("greedy", "greedy (the policy's argmax) | dynamic (sample the policy)")
    seed: int = param(0, "seed of the dynamic policy (a request's own seed wins)")

    def __post_init__(self) -> None:
        from adaspec.route.builtin import ROUTER_BUILTIN

        check(bool(self.artifact) or ROUTER_BUILTIN.is_file(),
              "give the router artifact, e.g. router:router.pt; `adaspec router collect` then "
              "`adaspec router train` build one (docs/router.md)")
        check(self.mode in MODES, "mode must be greedy or dynamic")

    @property
    def path(self) -> str:
        """The artifact given, or the one shipped for the built-in pair."""
        from adaspec.route.builtin import ROUTER_BUILTIN

        return self.artifact or str(ROUTER_BUILTIN)


def _needs_draft(params: RouterParams) -> bool:
    """When one of its arms does: reads the artifact's arm list."""
    from adaspec.methods.spec import parse_method
    from adaspec.route.artifact import load_artifact

    arms = load_artifact(params.path).arms.values()
    return any(parse_method(m).needs_draft_model() for m in arms)


def _build(params: RouterParams, models: Models, text: str):
    from adaspec.route.router import router_from_artifact

    if not models.target.has_hidden_states:
        raise InputError(
            f"method {text!r} reads the target's hidden state, which its backend "
            f"({type(models.target).__name__}) does not give; run the router on torch or ik "
            "weights"
        )
    return router_from_artifact(
        params.path, models.target, models.tokenizer, models.draft, models.eos_token_ids,
        mode=params.mode, seed=params.seed, profile=models.profile,
    )


METHOD = Method(
    "router",
    "a trained policy picks one of its arms (methods) per request from the prompt",
    RouterParams,
    _build,
    needs_draft=_needs_draft,
    positional="artifact",
    doc="docs/router.md",
)
