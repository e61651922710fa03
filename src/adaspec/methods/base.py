"""What a method is: a name, a summary, a typed parameter class and a `build` that turns the
params and the loaded models into an engine (`Method`), and those models (`Models`).

Apart from the registry (`methods.registry`), so a method's module imports only these types:
the registry imports the methods, none of them imports the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from adaspec.backends.base import ModelBackend
    from adaspec.cost.profile import CostProfile
    from adaspec.draft.history import HistoryIndex
    from adaspec.engine.loop import TextGenerator


@dataclass
class Models:
    """The loaded models a method builds on, the cost profile that prices cost-aware
    steps (None: the method's profile=..., else this machine's, measured once and cached),
    and the cross-request history a server shares between its engines (None: a method that
    drafts from history keeps its own, in memory)."""

    target: ModelBackend
    tokenizer: Any
    draft: ModelBackend | None = None
    eos_token_ids: list[int] | None = None
    profile: CostProfile | None = None
    history: HistoryIndex | None = None
    # a method composed of others (the router): its arms' engines, built on these models by
    # the composition root (`methods.build`) from what the method's `arms` names
    arms: dict[str, TextGenerator] | None = None

    def cost_profile(self, path: str = "", with_draft: bool = True) -> CostProfile:
        if self.profile is not None:
            return self.profile
        from adaspec.cost.cache import profile_for
        from adaspec.cost.profile import load_profile
        from adaspec.engine.overhead import loop_overhead_ms

        if path:
            return load_profile(path)
        return profile_for(self.target, self.draft if with_draft else None, self.tokenizer,
                           loop_overhead=loop_overhead_ms)


def _never(params: Any) -> bool:
    return False


def _fits(params: Any, models: Models, text: str) -> None:
    return None


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    params: type  # a frozen dataclass of typed parameters (methods.params)
    # (params, models, text); None: not an adaspec engine (the lab's bench-only references)
    build: Callable[[Any, Models, str], TextGenerator] | None
    needs_draft: Callable[[Any], bool] = _never  # reads the draft model's backend
    # the methods it composes, name -> method string (the router's arms; None: none): built
    # first and handed to `build` as `Models.arms`, their draft needs counted as its own
    arms: Callable[[Any], dict[str, str]] | None = None
    # (params, models, text): an InputError where the models cannot run it, before anything
    # (its arms included) is built or read
    check_models: Callable[[Any, Models, str], None] = _fits
    # what runs to draft a token, for a router's cost input: "target" (plain decoding: the
    # target itself), "nothing" (a lookup), "" (the draft model, where the method reads one);
    # `own_parameters` instead, where the method's parameters decide
    drafts_with: str = ""
    # (params, target name, the draft model's parameters or None) -> parameters a drafted
    # token runs through (the head's own; auto's, the most of its sources)
    own_parameters: Callable[[Any, str, int | None], int] | None = None
    positional: str | None = None  # `name:VALUE` sets this parameter (router:PATH)
    doc: str = ""  # the docs page that explains it (relative to the repository root)
