"""The method registry: what a method string's name selects.

A method is a name, a summary, a typed parameter class and a `build` that turns the params
and the loaded models into an engine. Adding one (a new drafter, say) is one module that
defines its `METHOD`, plus its line in `BUILTIN`; nothing else dispatches on method names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from adaspec.registry import Registry

if TYPE_CHECKING:
    from adaspec.backends.base import ModelBackend
    from adaspec.cost.profile import CostProfile
    from adaspec.draft.history import HistoryIndex
    from adaspec.engine.loop import TextGenerator

# The built-in methods, in the order `adaspec methods` and the README list them:
# "module:attribute" of each Method.
BUILTIN = (
    "adaspec.methods.plain:METHOD",
    "adaspec.methods.draft:METHOD",
    "adaspec.methods.ngram:METHOD",
    "adaspec.methods.auto:METHOD",
    "adaspec.route.method:METHOD",
    "adaspec.methods.s2d:METHOD",
)


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


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    params: type  # a frozen dataclass of typed parameters (methods.params)
    # (params, models, text); None: not an adaspec engine (the lab's bench-only references)
    build: Callable[[Any, Models, str], TextGenerator] | None
    needs_draft: Callable[[Any], bool] = _never  # reads the draft model's backend
    positional: str | None = None  # `name:VALUE` sets this parameter (router:PATH)
    doc: str = ""  # the docs page that explains it (relative to the repository root)


def _load_builtin() -> None:
    for entry in BUILTIN:
        module, _, attr = entry.partition(":")
        method = getattr(importlib.import_module(module), attr)
        METHODS.register(method.name, method)


METHODS: Registry[Method] = Registry("method", loader=_load_builtin)
