"""Verifiers: decide which drafted tokens the target accepts, keeping the target's
distribution. One interface for chains and trees (`base.Verifier`), one registry, and one
function, `choose`, that holds every rule about which verifier may check what."""

from __future__ import annotations

from collections.abc import Callable

from adaspec.errors import InputError
from adaspec.registry import Registry
from adaspec.verify.base import Verdict, Verifier
from adaspec.verify.greedy import GreedyVerifier
from adaspec.verify.multi_candidate import (
    MCNSVerifier,
    MCSSVerifier,
    MCSSWithoutReplacementVerifier,
)
from adaspec.verify.speculative import SpeculativeVerifier, speculative_sample

DEFAULT = "default"  # greedy at temperature 0; above it, speculative for chains, mcss-wor for trees
OLD_DEFAULT = "auto"  # DEFAULT's name before issue 32: an InputError naming the new one

VERIFIERS: Registry[Callable[[], Verifier]] = Registry("verifier")
for _factory in (
    GreedyVerifier,
    SpeculativeVerifier,
    MCSSVerifier,
    MCSSWithoutReplacementVerifier,
    MCNSVerifier,
):
    VERIFIERS.register(_factory.name, _factory)


def verifier_names() -> list[str]:
    return [DEFAULT, *VERIFIERS.names()]


def check_verifier_name(name: str) -> None:
    """An InputError unless `name` is a verifier's (or `default`), naming the fix."""
    if name == OLD_DEFAULT:
        raise InputError(f"verify={OLD_DEFAULT} is now verify={DEFAULT}")
    if name not in verifier_names():
        raise InputError(f"unknown verifier {name!r}; use one of {verifier_names()}")


def choose(
    verifier: str | Verifier | None, trees: bool, greedy: bool | None = None
) -> Verifier:
    """The verifier for a drafter that proposes chains or (`trees`) token trees, at
    temperature 0 (`greedy`) or above; None when the temperature is not known yet (a
    method's settings are checked before any request). Every mismatch is an InputError."""
    if isinstance(verifier, str):
        check_verifier_name(verifier)
    if verifier is None or verifier == DEFAULT:
        if greedy or greedy is None:
            return GreedyVerifier()
        return MCSSWithoutReplacementVerifier() if trees else SpeculativeVerifier()
    chosen = VERIFIERS[verifier]() if isinstance(verifier, str) else verifier
    if trees and not chosen.walks_trees:
        raise InputError(
            f"verify={chosen.name} checks chains; a token tree needs verify="
            f"{', '.join(n for n, f in VERIFIERS.items() if f().walks_trees)}"
        )
    if chosen.greedy and greedy is False:
        others = [n for n, f in VERIFIERS.items()
                  if not f().greedy and (f().walks_trees or not trees)]
        raise InputError(
            f"the {chosen.name} verifier only keeps the output exact at temperature 0; use "
            f"verify={' or '.join(others)} (or leave verify unset) for temperature > 0"
        )
    return chosen


__all__ = [
    "DEFAULT",
    "VERIFIERS",
    "GreedyVerifier",
    "MCNSVerifier",
    "MCSSVerifier",
    "MCSSWithoutReplacementVerifier",
    "SpeculativeVerifier",
    "Verdict",
    "Verifier",
    "check_verifier_name",
    "choose",
    "speculative_sample",
    "verifier_names",
]
