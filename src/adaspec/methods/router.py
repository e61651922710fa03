"""`router`: a trained policy picks one of its arms (methods) per request (`route/` holds
the policy, its artifact and the routing engine; the arms' engines come built, `Models.arms`)."""

from __future__ import annotations

from dataclasses import dataclass

from adaspec.errors import InputError
from adaspec.methods.base import Method, Models
from adaspec.methods.params import check, param
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


def _arms(params: RouterParams) -> dict[str, str]:
    """The artifact's arms (name -> method), which the composition root builds first."""
    from adaspec.route.artifact import load_artifact

    return dict(load_artifact(params.path).arms)


def _check_models(params: RouterParams, models: Models, text: str) -> None:
    if not models.target.has_hidden_states:
        raise InputError(
            f"method {text!r} reads the target's hidden state, which its backend "
            f"({type(models.target).__name__}) does not give; run the router on torch or ik "
            "weights"
        )


def _build(params: RouterParams, models: Models, text: str):
    from typing import cast

    from adaspec.engine.loop import Engine
    from adaspec.route.artifact import load_artifact
    from adaspec.route.router import RoutedGenerator

    art = load_artifact(params.path)
    art.check(target=models.target.name, hidden_size=models.target.hidden_size)
    engines = {name: cast(Engine, e) for name, e in (models.arms or {}).items()}
    return RoutedGenerator(engines, art.policy, mode=params.mode, seed=params.seed)


METHOD = Method(
    "router",
    "a trained policy picks one of its arms (methods) per request from the prompt",
    RouterParams,
    _build,
    arms=_arms,
    check_models=_check_models,
    positional="artifact",
    doc="docs/router.md",
)
