"""One small registry type, used once per concept (methods, verifiers, length controllers),
so a name given on the command line, in the library or in a request resolves in one place
and an unknown one is an error that lists the known ones."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from adaspec.errors import InputError

T = TypeVar("T")


class Registry(Generic[T]):
    """Names -> entries. `loader`, if given, runs once before the first lookup: it imports
    the modules that register the built-in entries (lazily, so importing a registry stays
    cheap and free of import cycles)."""

    def __init__(self, what: str, loader: Callable[[], None] | None = None) -> None:
        self.what = what
        self._entries: dict[str, T] = {}
        self._loader = loader

    def _load(self) -> None:
        if self._loader is not None:
            loader, self._loader = self._loader, None
            loader()

    def register(self, name: str, entry: T) -> T:
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def __getitem__(self, name: str) -> T:
        self._load()
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise InputError(
                f"unknown {self.what} {name!r}; known: {', '.join(self.names())}"
            ) from None

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def names(self) -> list[str]:
        self._load()
        return list(self._entries)

    def items(self) -> list[tuple[str, T]]:
        self._load()
        return list(self._entries.items())


def register_builtin(registry: Registry, entries: tuple[str, ...]) -> None:
    """Register the entries named "module:attribute" (each has a `name`), in order: a
    registry's loader for its built-in list, which imports its entries' modules so that
    none of them imports the list."""
    for entry in entries:
        module, _, attr = entry.partition(":")
        item = getattr(importlib.import_module(module), attr)
        registry.register(item.name, item)
