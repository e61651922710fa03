"""Per-module mutation scores from mutmut's results (mutants/**/*.meta), for docs/mutation.md.

    python experiments/mutation_report.py                 # print the table
    python experiments/mutation_report.py --write docs/mutation.md
    python experiments/mutation_report.py --survivors     # surviving mutants, one a line
    python experiments/mutation_report.py --integrity-globs   # the store group's mutant names
    python experiments/mutation_report.py --unchecked engine verify   # not yet run, by group

The decode path counts every mutant of its modules; the store modules count only the
integrity functions below (checksums, the hash record, atomic writes), the group `make
mutation` runs there. Score = (killed + timeout) / (every mutant checked, survivors, and
mutants no selected test reaches). Survivors listed in EQUIVALENT are shown with the reason
they cannot be killed, and a second score leaves them out; the first score is never
adjusted. `--write` replaces the text between the `<!-- scores -->` and `<!-- /scores -->`
markers of the page and keeps the rest.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "mutants"

# The store's integrity code: whole atomic.py, the checksum functions of the others.
INTEGRITY = {
    "adaspec.store.atomic": ["*"],
    "adaspec.store.assembly": [
        "sha256_file", "_read_chunks", "_hash_record_path", "_stat_key", "remember_sha256",
        "recalled_sha256", "cached_sha256", "check_gguf_magic", "check_assembled",
        "_write_parts", "assemble",
    ],
    "adaspec.store.loading": ["verify_cache_dir", "_read_marker", "_cache_is_current"],
}

# Survivors judged equivalent (no test can tell them from the original): name -> reason.
EQUIVALENT: dict[str, str] = {}

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests",
          34: "skipped", 35: "suspicious", 36: "timeout", -24: "timeout", 24: "timeout",
          152: "timeout", 255: "timeout", -11: "segfault", -9: "segfault",
          37: "caught by type check", 2: "interrupted", None: "not checked"}


def integrity_globs() -> list[str]:
    out = []
    for module, funcs in INTEGRITY.items():
        for f in funcs:
            out.append(f"{module}.*" if f == "*" else f"{module}.x_{f}__mutmut_*")
    return out


def counted(module: str, mutant: str) -> bool:
    if not module.startswith("adaspec.store."):
        return True
    return any(fnmatch.fnmatch(mutant, g) for g in integrity_globs()
               if g.startswith(module + "."))


def function_of(mutant: str) -> str:
    """'adaspec.engine.loop.xǁEngineǁ_step__mutmut_3' -> 'Engine._step'."""
    name = mutant.rsplit("__mutmut_", 1)[0].rsplit(".", 1)[-1]
    name = name[1:] if name.startswith("x") else name
    return ".".join(p for p in re.split("ǁ", name.lstrip("_") if name.startswith("_ǁ")
                                        else name) if p) or name


def load() -> dict[str, dict[str, str]]:
    """module -> {mutant name: status}."""
    results: dict[str, dict[str, str]] = {}
    for meta in sorted(MUTANTS.glob("src/**/*.py.meta")):
        module = ".".join(meta.relative_to(MUTANTS / "src").with_suffix("").with_suffix("")
                          .parts)
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        statuses = {m: STATUS.get(c, f"exit {c}") for m, c in codes.items() if counted(module, m)}
        if statuses:
            results[module] = statuses
    return results


GROUPS = {
    "engine": ["engine.loop", "engine.proposal", "engine.sampling", "engine.token_tree",
               "engine.text"],
    "draft": ["draft.model", "draft.model_tree", "draft.ngram", "draft.rates", "draft.base"],
    "auto": ["draft.auto"],
    "verify": ["verify."],
    "control": ["control."],
    "integrity": ["store."],
}


def in_groups(module: str, groups: list[str]) -> bool:
    short = module.removeprefix("adaspec.")
    return any(short == p or (p.endswith(".") and short.startswith(p))
               for g in groups for p in GROUPS[g])


def group_of(module: str) -> str:
    return "integrity" if module.startswith("adaspec.store.") else "decode"


def table(results: dict[str, dict[str, str]]) -> str:
    head = ("| module | mutants | killed | timeout | survived | no tests | not checked "
            "| score | equivalent | score without them |")
    lines = [head, "|" + " --- |" * 10]
    totals: dict[str, Counter] = {}
    for module, statuses in results.items():
        c = Counter(statuses.values())
        eq = sum(1 for m, s in statuses.items() if s == "survived" and m in EQUIVALENT)
        c["equivalent"] = eq
        c["total"] = len(statuses)
        totals.setdefault(group_of(module), Counter()).update(c)
        lines.append(row(module.removeprefix("adaspec."), c))
    for group, c in totals.items():
        lines.append(row(f"**{group} (all)**", c))
    return "\n".join(lines)


def row(name: str, c: Counter) -> str:
    killed = c["killed"] + c["timeout"]
    checked = killed + c["survived"] + c["no tests"] + c["suspicious"] + c["segfault"]
    score = f"{100 * killed / checked:.1f}%" if checked else "-"
    rest = checked - c["equivalent"]
    score_eq = f"{100 * killed / rest:.1f}%" if rest else "-"
    return (f"| {name} | {c['total']} | {c['killed']} | {c['timeout']} | {c['survived']} "
            f"| {c['no tests']} | {c['not checked']} | {score} | {c['equivalent']} "
            f"| {score_eq} |")


def survivors(results: dict[str, dict[str, str]]) -> list[str]:
    return [m for statuses in results.values() for m, s in statuses.items()
            if s in ("survived", "no tests")]


def equivalent_list(results: dict[str, dict[str, str]]) -> str:
    lines = []
    for statuses in results.values():
        for m, s in statuses.items():
            if s == "survived" and m in EQUIVALENT:
                lines.append(f"- `{m.removeprefix('adaspec.')}`: {EQUIVALENT[m]}")
    return "\n".join(lines) or "(none)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="replace the scores block of this page")
    ap.add_argument("--survivors", action="store_true")
    ap.add_argument("--integrity-globs", action="store_true")
    ap.add_argument("--unchecked", nargs="+", choices=sorted(GROUPS), metavar="GROUP",
                    help="print the mutants of these groups not run yet (for `mutmut run`)")
    args = ap.parse_args()
    if args.integrity_globs:
        print(" ".join(f"'{g}'" for g in integrity_globs()))
        return 0
    if not MUTANTS.is_dir():
        print("no mutants/ folder: run `make mutation` first", file=sys.stderr)
        return 1
    results = load()
    if args.unchecked:
        print(" ".join(m for module, statuses in results.items()
                       if in_groups(module, args.unchecked)
                       for m, st in statuses.items() if st == "not checked"))
        return 0
    if args.survivors:
        print("\n".join(survivors(results)))
        return 0
    block = (table(results) + "\n\nSurvivors judged equivalent:\n\n"
             + equivalent_list(results))
    if args.write is None:
        print(block)
        return 0
    page = args.write.read_text()
    start, end = "<!-- scores -->", "<!-- /scores -->"
    if start not in page or end not in page:
        print(f"{args.write} has no {start} ... {end} block", file=sys.stderr)
        return 1
    before, rest = page.split(start, 1)
    after = rest.split(end, 1)[1]
    args.write.write_text(f"{before}{start}\n{block}\n{end}{after}")
    print(f"wrote the scores to {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
