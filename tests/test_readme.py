"""The README's method tables are the registries' (`adaspec methods --markdown`), and every
registered method, controller and verifier appears in them: adding one without documenting
it fails here."""

from __future__ import annotations

from pathlib import Path

import adaspec.lab.bench.references  # noqa: F401  (ctrl=oracle: `adaspec methods` lists it)
from adaspec.control import CONTROLLERS
from adaspec.methods.registry import METHODS
from adaspec.methods.spec import methods_markdown
from adaspec.verify import VERIFIERS

ROOT = Path(__file__).resolve().parents[1]


def readme_tables() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start, end = "<!-- methods:start -->\n", "\n<!-- methods:end -->"
    assert start in text and end in text, "README lost its generated methods tables"
    return text[text.index(start) + len(start) : text.index(end)]


def test_readme_tables_equal_the_registries():
    assert readme_tables() == methods_markdown(), (
        "README.md is out of date: paste the output of `adaspec methods --markdown` between "
        "its methods markers"
    )


def test_every_registered_name_has_a_row():
    table = methods_markdown()
    for name in [*METHODS.names(), *CONTROLLERS.names(), *VERIFIERS.names()]:
        assert f"| `{name}` |" in table


def test_the_docs_each_method_links_exist():
    for _, method in METHODS.items():
        assert method.doc and (ROOT / method.doc).is_file(), method.name
