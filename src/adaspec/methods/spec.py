"""The one parser for method strings, shared by the CLI, the bench and the library.

Grammar: ``NAME[:key=value[,key=value...]][@WEIGHTS[/DRAFT_WEIGHTS]]``, e.g. ``ar``, ``ngram:k=8``,
``draft:k=4``, ``draft:ctrl=heuristic,k=4``, ``draft:k=6,verify=speculative``,
``draft:tree=4x2x2x1,verify=mcss-wor`` (a token tree, multi-candidate verification),
``draft:k=4@int8/int4`` (int8 target, int4 draft weights). The name selects an entry of the
method registry (`methods.registry.METHODS`), whose typed parameter class checks the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adaspec.backends.weights import WEIGHT_VARIANTS
from adaspec.errors import InputError
from adaspec.methods.base import Method
from adaspec.methods.params import UnknownParameter, as_dict, build_params, fields_of
from adaspec.methods.registry import METHODS
from adaspec.registry import Registry

DEFAULT_METHOD = "auto"  # what `adaspec generate` and `load_generator` run


@dataclass(frozen=True)
class MethodSpec:
    name: str
    params: Any  # the method's typed parameter dataclass
    text: str = ""
    # `@int8/int4` after the method: the weights of target / draft for this method (None:
    # whatever the run loaded), so the bench can put weights variants side by side.
    weights: str | None = None
    draft_weights: str | None = None
    method: Method | None = None

    def __getitem__(self, key: str) -> object:
        return getattr(self.params, key)

    def settings(self) -> dict[str, object]:
        """The parameters as a plain dict (for results files)."""
        return as_dict(self.params)

    def needs_draft_model(self) -> bool:
        """Whether building it needs the draft model (a method composed of others, the
        router, when one of its arms does)."""
        if self.method is None:
            return False
        arms = self.method.arms(self.params) if self.method.arms is not None else {}
        return self.method.needs_draft(self.params) or any(
            parse_method(m).needs_draft_model() for m in arms.values())

    def check_files(self) -> None:
        """The files its parameters name exist: a one-line InputError before any model
        loads, not after (parameters with a `check_files` method say how to look)."""
        check_files = getattr(self.params, "check_files", None)
        if callable(check_files):
            check_files()

    @property
    def tree(self) -> tuple[int, ...] | None:
        """Branching factors per level when the method drafts a token tree."""
        return getattr(self.params, "branching", None)

    @property
    def is_reference(self) -> bool:
        """A method adaspec does not build (the bench's references): run by the bench only."""
        return self.method is not None and self.method.build is None


def split_method_list(text: str) -> list[str]:
    """Split "ar,ngram,draft:k=4,verify=mcss" into method strings: a comma starts a new
    method only when what follows is not a `key=value` parameter of the previous one."""
    methods: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if methods and "=" in part and ":" not in part.split("=", 1)[0]:
            methods[-1] += "," + part
        else:
            methods.append(part)
    return methods


def _parse_variant(text: str, variant: str) -> tuple[str | None, str | None]:
    """`int8` or `int8/int4` (target / draft weights) after a method's `@`: a torch
    quantization, or `gguf` / `ik` (the model's GGUF run by llama.cpp / ik_llama.cpp)."""
    weights, _, draft_weights = (v.strip() for v in variant.partition("/"))
    for value in (weights, draft_weights):
        if value and value not in WEIGHT_VARIANTS:
            raise InputError(
                f"method {text!r}: unknown weights {value!r} after '@'; use "
                f"{'|'.join(WEIGHT_VARIANTS)}, e.g. draft:k=4@int8/int4 (target/draft)"
            )
    if not weights:
        raise InputError(f"method {text!r}: give the weights after '@', e.g. ar@int8")
    return weights, draft_weights or None


def parse_method(text: str, extra: Registry[Method] | None = None) -> MethodSpec:
    """Parse and validate a method string; every mistake is an InputError naming the fix.

    `extra`: more methods to accept (the bench's reference methods, `lab.bench.references`).
    """
    known = ", ".join(METHODS.names())
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"empty method name; known methods: {known}")
    text = text.strip()
    body, at, variant = text.partition("@")
    weights, draft_weights = _parse_variant(text, variant) if at else (None, None)
    name, _, rest = body.partition(":")
    name = name.strip()
    if name in METHODS:
        method = METHODS[name]
    elif extra is not None and name in extra:
        method = extra[name]
    else:
        raise InputError(f"unknown method {name!r}; known methods: {known}")
    items: dict[str, str] = {}
    if method.positional and rest.strip() and "=" not in rest.split(",", 1)[0]:
        value, _, rest = rest.partition(",")  # router:PATH[,mode=dynamic]
        items[method.positional] = value.strip()
    for item in rest.split(",") if rest.strip() else []:
        key, eq, value = item.partition("=")
        if not eq:
            raise InputError(f"method {text!r}: expected key=value, got {item!r}")
        items[key.strip()] = value.strip()
    try:
        params = build_params(method.params, items)
    except UnknownParameter as exc:
        raise InputError(f"method {name!r} {exc}") from None
    except InputError as exc:
        raise InputError(f"method {text!r}: {exc}") from None
    return MethodSpec(name, params, text, weights, draft_weights, method)


def describe_methods(extra: Registry[Method] | None = None) -> str:
    """`adaspec methods`: every method with its parameters, defaults and help."""
    lines = []
    entries = METHODS.items() + (extra.items() if extra is not None else [])
    for name, method in entries:
        lines.append(f"{name}: {method.summary}")
        for key, kind, default, help_ in fields_of(method.params):
            lines.append(f"    {key}={default!s:<8} ({kind.__name__}) {help_}")
    return "\n".join(lines)


def methods_markdown() -> str:
    """The README's tables of methods, length controllers and verifiers, generated from
    their registries (`adaspec methods --markdown`; a test keeps the README equal to it)."""
    from adaspec.control import CONTROLLERS
    from adaspec.verify import VERIFIERS

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| method | what it does | parameters (default) |", "| --- | --- | --- |"]
    for name, method in METHODS.items():
        params = ", ".join(f"`{key}={default}`" for key, _, default, _ in fields_of(method.params))
        doc = f" ([{method.doc.removeprefix('docs/')}]({method.doc}))" if method.doc else ""
        lines.append(f"| `{name}` | {cell(method.summary)}{doc} | {params or 'none'} |")
    lines += ["", "| `ctrl=` | length controller |", "| --- | --- |"]
    for name, kind in CONTROLLERS.items():
        needs = " (draft model only)" if kind.reads_draft else ""
        lines.append(f"| `{name}` | {cell(kind.summary)}{needs} |")
    lines += ["", "| `verify=` | verifier |", "| --- | --- |",
              "| `default` | greedy at temperature 0; above it, speculative (chains) or "
              "mcss-wor (trees) |"]
    for name, factory in VERIFIERS.items():
        verifier = factory()
        scope = "chains and trees" if verifier.walks_trees else "chains"
        lines.append(f"| `{name}` | {cell(verifier.summary)} ({scope}) |")
    return "\n".join(lines)
