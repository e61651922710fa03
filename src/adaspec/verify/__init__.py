"""Verifiers: decide which drafted tokens the target accepts, keeping the target's distribution."""

from __future__ import annotations

from collections.abc import Callable

from adaspec.errors import InputError
from adaspec.verify.base import Verdict, Verifier
from adaspec.verify.greedy import GreedyVerifier
from adaspec.verify.speculative import SpeculativeSampler, speculative_sample

# One place maps names to verifiers, so CLI, bench and server accept the same strings.
_REGISTRY: dict[str, Callable[[], Verifier]] = {
    "greedy": GreedyVerifier,
    "speculative": SpeculativeSampler,
}


def get_verifier(name: str) -> Verifier:
    """A fresh verifier by name; unknown names raise InputError listing the known ones."""
    try:
        factory = _REGISTRY[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(_REGISTRY))
        raise InputError(f"unknown verifier {name!r}; known verifiers: {known}") from None
    return factory()


__all__ = [
    "GreedyVerifier",
    "SpeculativeSampler",
    "Verdict",
    "Verifier",
    "get_verifier",
    "speculative_sample",
]
