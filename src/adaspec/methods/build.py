"""Assemble an engine from a method string and loaded models.

Models load once; `build_generator` is cheap, so the bench can switch methods on the same
loaded target and draft. What a method name builds is the method registry's business
(`methods.registry`): nothing here dispatches on names.
"""

from __future__ import annotations

from typing import cast

from adaspec.backends.base import ModelBackend
from adaspec.backends.load import load_backends
from adaspec.backends.weights import FASTEST
from adaspec.cost.profile import CostProfile
from adaspec.draft.history import HistoryIndex
from adaspec.engine.loop import Engine, TextGenerator
from adaspec.errors import InputError
from adaspec.methods.arms import check_arms
from adaspec.methods.base import Models
from adaspec.methods.spec import DEFAULT_METHOD, MethodSpec, parse_method
from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT


def build_generator(
    method: str | MethodSpec,
    target: ModelBackend,
    tokenizer,
    draft: ModelBackend | None = None,
    eos_token_ids: list[int] | None = None,
    profile: CostProfile | None = None,
    history: HistoryIndex | None = None,
) -> TextGenerator:
    """The generator of a method on loaded models (an `Engine`, or a `TextGenerator` composed
    of engines, such as the router's). `profile` prices the steps of cost-aware
    methods (`auto`, DISCO's stop=cost, tree=priced); by default, the method's profile=...,
    else this machine's profile of these models (measured on first use, then cached).
    `history`: the cross-request index a method drafting from history uses (a server shares
    one between its engines); by default each such engine keeps its own."""
    spec = parse_method(method) if isinstance(method, str) else method
    if spec.method is None or spec.method.build is None:
        raise InputError(f"method {spec.text!r} is run by `adaspec bench` only")
    models = Models(target, tokenizer, draft, eos_token_ids, profile, history)
    spec.method.check_models(spec.params, models, spec.text)
    if spec.method.arms is not None:  # a method composed of others: those first
        models.arms = dict(build_arm_generators(spec.method.arms(spec.params), target, tokenizer,
                                             draft, eos_token_ids, profile))
    return spec.method.build(spec.params, models, spec.text)


def build_arm_generators(
    arms: dict[str, str],
    target: ModelBackend,
    tokenizer,
    draft: ModelBackend | None = None,
    eos_token_ids: list[int] | None = None,
    profile: CostProfile | None = None,
) -> dict[str, Engine]:
    """One engine per arm of a router (name -> method string); `profile` prices the
    cost-aware arms (auto, DISCO's stop=cost, tree=priced), by default each arm's own
    profile=... or this machine's."""
    specs = check_arms(arms)
    return {  # every arm's method decodes with an Engine (check_arms refuses a router)
        name: cast(Engine, build_generator(spec, target, tokenizer, draft, eos_token_ids,
                                        profile=profile))
        for name, spec in specs.items()
    }


def load_generator(
    method: str = DEFAULT_METHOD,
    target: str = TARGET_DEFAULT,
    draft: str | None = DRAFT_DEFAULT,
    dtype: str = "bfloat16",
    weights: str = FASTEST,
    draft_weights: str = FASTEST,
    device: str = "auto",
) -> TextGenerator:
    """Load the models a method needs (from the verified cache, with the weights asked for:
    `fastest`, a torch quantization or a llama.cpp runtime, on `device`) and build its
    generator."""
    spec = parse_method(method)
    if spec.needs_draft_model() and draft is None:
        raise InputError(f"method {spec.text!r} needs a draft model (--draft)")
    tgt, tokenizer, drf, eos = load_backends(  # a method's own `@int8/int4` wins
        target, draft if spec.needs_draft_model() else None, dtype, spec.weights or weights,
        spec.draft_weights or draft_weights, device=device,
    )
    return build_generator(spec, tgt, tokenizer, drf, eos_token_ids=eos)
