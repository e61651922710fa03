"""`adaspec models restrict-vocab` on a tiny HF draft directory and a fake results file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaspec.cli import main
from adaspec.store.token_set import load_token_set


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_writes_sets_with_specials_and_provenance(tmp_path, model_dirs, capsys):
    _, draft = model_dirs
    results = tmp_path / "run" / "results.jsonl"
    results.parent.mkdir()
    rows = [
        {"prompt_id": "p/0", "method": "ar", "token_ids": [40, 41, 42, 40]},
        {"prompt_id": "p/1", "method": "ar", "token_ids": [200, 201]},
        {"prompt_id": "p/1", "method": "draft:k=2", "token_ids": [250]},
    ]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["models", "restrict-vocab", "--draft", draft, "--top", "8,16"]
    argv += ["--results", str(results), "--exclude-prompts", "p/1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("draft: top") == 2 and "covers 100.0% of the counted tokens" in out
    small = load_token_set("draft", 8)
    # the 3 special tokens of the tiny tokenizer, the 3 counted ids, then the lowest ids
    from tests.conftest import bpe_tokenizer

    specials = set(bpe_tokenizer().all_special_ids)
    assert specials | {40, 41, 42} <= set(small.token_ids)
    assert {200, 201, 250}.isdisjoint(small.token_ids)
    info = small.provenance
    assert info["excluded_prompts"] == ["p/1"] and info["tokens"] == 4
    assert info["sources"][0]["path"] == str(results)
    assert load_token_set("draft", 16).size == 16


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--top", "x"], "--top must be integers"),
        (["--top", "0"], "positive"),
        (["--top", "8", "--results", "/nonexistent/r.jsonl"], "not found"),
    ],
)
def test_bad_input_is_one_line(extra, message, model_dirs, capsys):
    _, draft = model_dirs
    assert main(["models", "restrict-vocab", "--draft", draft, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_no_target_outputs_is_an_error(tmp_path, model_dirs, capsys):
    _, draft = model_dirs
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps({"prompt_id": "p", "method": "ngram", "token_ids": [1]}) + "\n")
    argv = ["models", "restrict-vocab", "--draft", draft, "--top", "8", "--results", str(results)]
    assert main(argv) == 2
    assert "no target outputs" in capsys.readouterr().err


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lab_results(root: Path) -> None:
    """Results files where the repository keeps (or kept) its lab output."""
    for folder in ("experiments/results/run", "benchmarks/results/run"):
        row = {"prompt_id": "lab", "method": "ar", "token_ids": [300, 301]}
        write_rows(root / folder / "results.jsonl", [row])


def test_without_results_and_bench_runs_is_a_one_line_error(
    tmp_path, model_dirs, capsys, monkeypatch
):
    """Lab results in the current folder are not a default source."""
    _, draft = model_dirs
    lab_results(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["models", "restrict-vocab", "--draft", draft, "--top", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--results" in err and "bench-results" in err and "\n" not in err


def test_default_counts_the_users_bench_runs_only(tmp_path, model_dirs, capsys, monkeypatch):
    """Without --results: `adaspec bench`'s default output folder, not the lab's results."""
    _, draft = model_dirs
    lab_results(tmp_path)
    row = {"prompt_id": "p/0", "method": "ar", "token_ids": [40, 41]}
    own = write_rows(tmp_path / "bench-results" / "spec-bench" / "results.jsonl", [row])
    monkeypatch.chdir(tmp_path)
    assert main(["models", "restrict-vocab", "--draft", draft, "--top", "8"]) == 0
    capsys.readouterr()
    info = load_token_set("draft", 8).provenance
    assert [s["path"] for s in info["sources"]] == [str(own.relative_to(tmp_path))]
    assert info["tokens"] == 2
