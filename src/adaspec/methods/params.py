"""Typed method parameters: each method declares a frozen dataclass whose fields carry a
type, a default and a help text; the parser converts `key=value` strings by the field's type
and the dataclass checks its own values (`__post_init__`), so a method's settings are
checked in one place, before any model loads."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from adaspec.errors import InputError

if TYPE_CHECKING:
    from adaspec.control import LengthSettings


class UnknownParameter(InputError):
    """A `key=value` whose key the method does not take."""


def param(default: Any, help: str) -> Any:
    """A method parameter: its default and a one-line help (shown by `adaspec methods`)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class NoParams:
    """A method without parameters."""


def fields_of(cls: type) -> list[tuple[str, type, Any, str]]:
    """(name, type, default, help) of every parameter, in declaration order."""
    hints = typing.get_type_hints(cls)
    return [
        (f.name, hints[f.name], f.default, f.metadata.get("help", ""))
        for f in dataclasses.fields(cls)
    ]


def build_params(cls: type, items: dict[str, str]) -> Any:
    """The params object from `key=value` strings; unknown keys and bad values raise
    InputError naming the key."""
    kinds = {name: kind for name, kind, _, _ in fields_of(cls)}
    values: dict[str, Any] = {}
    for key, raw in items.items():
        if key not in kinds:
            raise UnknownParameter(
                f"has no parameter {key!r} (parameters: {', '.join(kinds) or 'none'})"
            )
        kind = kinds[key]
        try:
            values[key] = kind(raw)
        except ValueError:
            raise InputError(f"{key} must be {kind.__name__}, got {raw!r}") from None
    return cls(**values)


def as_dict(params: Any) -> dict[str, Any]:
    return dataclasses.asdict(params)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise InputError(message)


@dataclass(frozen=True)
class ChainParams:
    """What every drafting method with a length controller and a verifier takes."""

    k: int = param(4, "tokens to draft per step (initial k for ctrl=heuristic)")
    ctrl: str = param(
        "static", "length controller: static | heuristic (draft: also confidence | disco | oracle)"
    )
    k_max: int = param(16, "upper bound on k for ctrl=heuristic and ctrl=oracle")
    verify: str = param(
        "default",
        "verifier: default (greedy at T=0, speculative above; mcss-wor above for trees) | "
        "greedy | speculative | mcss | mcss-wor | mcns (the last three also walk trees)",
    )

    def __post_init__(self) -> None:
        check(self.k >= 1, "k must be >= 1")
        self.check_ctrl_and_verify()

    def length_settings(self) -> LengthSettings:
        """What `ctrl`'s controller is built from."""
        from adaspec.control import LengthSettings

        return LengthSettings(k=self.k, k_max=max(self.k, self.k_max))

    def check_ctrl_and_verify(self) -> None:
        from adaspec.control import CONTROLLERS
        from adaspec.verify import check_verifier_name

        if self.ctrl not in CONTROLLERS:
            raise InputError(
                f"unknown length controller {self.ctrl!r}; use one of {CONTROLLERS.names()}"
            )
        check_verifier_name(self.verify)
