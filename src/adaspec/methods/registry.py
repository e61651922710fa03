"""The method registry: what a method string's name selects.

Adding a method (a new drafter, say) is one module that defines its `METHOD`
(`methods.base.Method`), plus its line in `BUILTIN`; nothing else dispatches on method
names. The registry imports the methods (lazily, on the first lookup); they import only
`methods.base`.
"""

from __future__ import annotations

from adaspec.methods.base import Method
from adaspec.registry import Registry, register_builtin

# The built-in methods, in the order `adaspec methods` and the README list them:
# "module:attribute" of each Method.
BUILTIN = (
    "adaspec.methods.plain:METHOD",
    "adaspec.methods.draft:METHOD",
    "adaspec.methods.ngram:METHOD",
    "adaspec.methods.auto:METHOD",
    "adaspec.methods.router:METHOD",
    "adaspec.methods.s2d:METHOD",
    "adaspec.methods.head:METHOD",
)


METHODS: Registry[Method] = Registry("method", loader=lambda: register_builtin(METHODS, BUILTIN))
