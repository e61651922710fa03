"""The layout rule: the runtime never imports the lab (bench, DISCO and router training).

The lab imports the runtime, not the reverse, so a server or a library user never pays for
(or breaks on) research code. Checked two ways: every runtime module imported in a fresh
interpreter loads no `adaspec.lab` module, and no runtime source file has an import of the
lab, not even a lazy one inside a function.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import adaspec

PACKAGE = Path(adaspec.__file__).parent
FRONT_ENDS = ("cli", "__main__")  # front ends may reach the lab, lazily, per command
# Runtime packages that need an optional extra: imported only where it is installed (the
# source scan below still reads them).
EXTRAS = {"serve": "fastapi"}


def runtime_modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[0] in ("lab", *FRONT_ENDS):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        extra = EXTRAS.get(parts[0]) if parts else None
        if extra is not None and importlib.util.find_spec(extra) is None:
            continue
        names.append(".".join(("adaspec", *parts)))
    return names


def _lab_loaded_after(code: str) -> list[str]:
    probe = code + (
        "\nimport sys, json"
        "\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('adaspec.lab'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_runtime_modules_load_no_lab_module():
    modules = runtime_modules()
    assert "adaspec.engine.loop" in modules and "adaspec.route.router" in modules
    if importlib.util.find_spec("fastapi") is not None:
        assert "adaspec.serve.app" in modules
    code = "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    assert _lab_loaded_after(code) == []


def test_the_rule_check_sees_a_lab_import():
    """Negative control: the probe does report a lab module when one is imported."""
    assert "adaspec.lab.bench.runner" in _lab_loaded_after("import adaspec.lab.bench.runner")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return found


def test_no_runtime_source_imports_the_lab_even_lazily():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ("lab", *FRONT_ENDS) or rel.name == "__main__.py":
            continue
        offenders += [f"{rel}: {m}" for m in _imports(path) if m.startswith("adaspec.lab")]
    assert offenders == []


PRODUCT_COMMANDS = ("generate", "models", "profile", "model_options")


def test_product_commands_load_no_lab_module():
    """`generate`, `models` and `profile` are product commands: their modules stay off the
    lab (the bench, disco and router commands reach it lazily, per command)."""
    code = "".join(f"import adaspec.cli.{name}\n" for name in PRODUCT_COMMANDS)
    assert _lab_loaded_after(code) == []


# The layers, bottom to top: a module imports only from its own package or a lower layer
# (lazy imports inside functions included). Front ends (`cli`, `__main__`) sit on top; the
# package root only re-exports, lazily.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "registry"),
    ("core",),  # the vocabulary: proposals, token trees, sampling, metrics, text
    ("store",),
    ("backends",),
    ("cost",),
    ("control",),
    ("draft", "verify"),
    ("engine",),  # the loop
    ("route",),  # the router's policy, artifact and routing engine (over built engines)
    ("methods",),  # method registrations and the composition root (methods/build.py)
    ("online",),
    ("serve",),
    ("lab",),
    ("cli", "__main__"),
)
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


# a string that names a module to import: "adaspec.x.y" or "adaspec.x.y:attribute" (a
# registry's built-in list, `importlib.import_module`'s argument)
IMPORT_STRING = re.compile(r"^(adaspec(?:\.[a-z_0-9]+)+)(?::[A-Za-z_][A-Za-z_0-9]*)?$")


def _type_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (imports for the type checker, never run)."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                hidden.update(id(n) for n in ast.walk(child))
    return hidden


def _adaspec_imports(path: Path) -> list[str]:
    """Every adaspec module a source file imports, at module level, lazily inside a function
    or by a string (`IMPORT_STRING`); `from adaspec import x` names adaspec.x. Imports for
    the type checker only are not counted."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    hidden = _type_only(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "adaspec" and node.level == 0:
            found += [f"adaspec.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = IMPORT_STRING.match(node.value)  # a file name such as "adaspec.json" is not
            if match and match.group(1).split(".")[1] in LEVEL:
                found.append(match.group(1))
    return [m for m in found if m.startswith("adaspec.")]


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (`_adaspec_imports`; a name imported from a
    module that is not itself a module counts as that module)."""
    paths = {_module_name(package, p): p for p in sorted(package.rglob("*.py"))}

    def module_of(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in paths.items():
        graph[module] = {m for m in map(module_of, _adaspec_imports(path))
                         if m is not None and m != module and m != "adaspec"}
    return graph


def import_circles(package: Path = PACKAGE) -> list[list[str]]:
    """The strongly connected groups of two modules or more (Tarjan): modules that import
    each other, however indirectly."""
    graph = import_graph(package)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circles():
    assert import_circles() == []


def test_the_circle_check_sees_a_lazy_and_a_string_import(tmp_path):
    """Negative control: a module that imports another lazily, which names the first in a
    registry string, is a circle; an import for the type checker only is not."""
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "a.py").write_text("def f():\n    from adaspec.core import b\n")
    (tmp_path / "core" / "b.py").write_text('BUILTIN = ("adaspec.core.a:THING",)\n')
    (tmp_path / "core" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from adaspec.core import d\n")
    (tmp_path / "core" / "d.py").write_text("from adaspec.core.c import X\n")
    assert import_circles(tmp_path) == [["adaspec.core.a", "adaspec.core.b"]]


def upward_imports(package: Path = PACKAGE) -> list[str]:
    offenders = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        own = rel.parts[0].removesuffix(".py")
        if own == "__init__":
            continue  # the root's lazy re-exports
        for module in _adaspec_imports(path):
            other = module.split(".")[1]
            if other != own and LEVEL[other] > LEVEL[own]:
                offenders.append(f"{rel} ({own}) imports {module} ({other})")
    return offenders


def test_every_package_has_a_layer():
    packages = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
                if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    assert packages - {"__init__"} <= set(LEVEL), sorted(packages - set(LEVEL))


def test_no_import_runs_up_the_layers():
    assert upward_imports() == []


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """Negative control: a core module that imports the engine is reported, and one that
    names a method module in a registry string."""
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "bad.py").write_text("def f():\n    from adaspec.engine import loop\n")
    (tmp_path / "core" / "worse.py").write_text('BUILTIN = ("adaspec.methods.plain:METHOD",)\n')
    assert upward_imports(tmp_path) == [
        "core/bad.py (core) imports adaspec.engine (engine)",
        "core/bad.py (core) imports adaspec.engine.loop (engine)",
        "core/worse.py (core) imports adaspec.methods.plain (methods)"]


def _module_name(package: Path, path: Path) -> str:
    parts = path.relative_to(package).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("adaspec", *parts))


def lab_only_modules(package: Path = PACKAGE) -> list[str]:
    """Runtime modules nothing outside the lab imports (or names in a registry string such as
    `methods.registry.BUILTIN`): they belong in the lab."""
    texts = {_module_name(package, p): p.read_text(encoding="utf-8")
             for p in package.rglob("*.py")}

    def in_runtime(module: str) -> bool:
        return module.split(".")[1:2] != ["lab"]

    used: set[str] = set()
    for module, text in texts.items():
        if not in_runtime(module):
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                used.add(node.module)
                used.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                used.update(alias.name for alias in node.names)
        used.update(m for m in texts if f'"{m}:' in text and m != module)
    return sorted(
        m for m, text in texts.items()
        if in_runtime(m) and m.count(".") >= 2 and m.split(".")[1] not in FRONT_ENDS
        and not m.endswith("__main__") and m not in used
        and not any(u.startswith(m + ".") for u in used)  # a package whose modules are used
    )


def test_no_runtime_module_serves_only_the_lab():
    assert lab_only_modules() == []


def test_the_lab_only_check_sees_one(tmp_path):
    """Negative control: a runtime module only the lab imports is reported."""
    for folder in ("core", "lab", "cli"):
        (tmp_path / folder).mkdir()
    (tmp_path / "core" / "used.py").write_text("X = 1\n")
    (tmp_path / "core" / "lonely.py").write_text("Y = 2\n")
    (tmp_path / "cli" / "main.py").write_text("from adaspec.core.used import X\n")
    (tmp_path / "lab" / "study.py").write_text("from adaspec.core.lonely import Y\n")
    assert lab_only_modules(tmp_path) == ["adaspec.core.lonely"]


# Private names of other libraries adaspec reads, each for a reason (no public way).
THIRD_PARTY_PRIVATE = {
    "backends/child_process.py: os._exit": "a forked child ends without running the "
                                           "parent's exit handlers",
    "backends/llamacpp/backend.py: self.llm._batch": "llama-cpp-python keeps its batch and "
    "context private; scoring every row of a block needs them",
    "backends/llamacpp/backend.py: self.llm._ctx": "(the same)",
    "backends/torch/static.py: torch._dynamo": "torch.compile's settings and its graph-break "
                                               "errors live there",
    "store/quant.py: torch._int_mm": "torch's int8 matrix product has no public name",
    "store/quant.py: torch.ops.aten._convert_weight_to_int4pack_for_cpu": "torch's int4 "
    "packing kernels have no public names",
    "store/quant.py: torch.ops.aten._weight_int4pack_mm_for_cpu": "(the same)",
    "store/quant.py: torch.ops.aten._weight_int8pack_mm": "(the same)",
    **{f"cli/{name}.py: argparse._SubParsersAction": "the type of `add_subparsers()` for the "
       "type checker" for name in ("bench", "disco", "generate", "osd", "profile", "router",
                                   "s2d", "serve", "head")},
}


def private_reads(package: Path = PACKAGE) -> list[str]:
    """`thing._name` reads (thing not self, cls or super()) of a private name the module does
    not define or assign itself: reads of another module's (or library's) private state."""
    rows = set()
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        own: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                own.add(node.value)  # __slots__ entries
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")) or node.attr in own:
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                    and value.func.id == "super"):
                continue
            rows.add(f"{path.relative_to(package)}: {ast.unparse(node)}")
    return sorted(rows)


def test_no_module_reads_another_modules_private_state():
    assert [r for r in private_reads() if r not in THIRD_PARTY_PRIVATE] == []


def test_the_private_read_check_sees_one(tmp_path):
    """Negative control: a server module reading a backend's private list is reported; the
    backend's own read of it is not."""
    (tmp_path / "backends").mkdir()
    (tmp_path / "serve").mkdir()
    (tmp_path / "backends" / "chain.py").write_text(
        "class Chain:\n    def __init__(self):\n        self._ids = []\n\n"
        "def held(c):\n    return c._ids\n")
    (tmp_path / "serve" / "slots.py").write_text("def pick(backend):\n    return backend._ids\n")
    assert private_reads(tmp_path) == ["serve/slots.py: backend._ids"]
