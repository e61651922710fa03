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
    ("methods",),  # method registrations and the composition root (methods/build.py)
    ("route", "online"),
    ("serve",),
    ("lab",),
    ("cli", "__main__"),
)
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def _adaspec_imports(path: Path) -> list[str]:
    """Every adaspec module a source file imports; `from adaspec import x` names adaspec.x."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "adaspec" and node.level == 0:
            found += [f"adaspec.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return [m for m in found if m.startswith("adaspec.")]


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
    """Negative control: a core module that imports the engine is reported."""
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "bad.py").write_text("def f():\n    from adaspec.engine import loop\n")
    assert upward_imports(tmp_path) == ["core/bad.py (core) imports adaspec.engine (engine)"]


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
