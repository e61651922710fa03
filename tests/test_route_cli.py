"""`adaspec router` and `adaspec generate --router`: results, and one-line errors (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch

from adaspec.route.artifact import RouterArtifact, load_artifact, save_artifact
from adaspec.route.policy import RouterPolicy
from tests.route_helpers import make_collection
from tests.test_cli import generate_args, home, run  # noqa: F401 (home: autouse fixture)

ARMS = {"ar": "ar", "ngram": "ngram", "draft:k=2": "draft:k=2"}



def test_generate_with_a_router(capsys, model_dirs, tmp_path):
    policy = RouterPolicy(32, len(ARMS), hidden=8)  # the tiny models' hidden size
    with torch.no_grad():
        policy.net[-1].weight.zero_()
        policy.net[-1].bias.copy_(torch.tensor([0.0, 0.0, 9.0]))
    # a model directory's name is its folder name: "target"
    path = save_artifact(RouterArtifact(ARMS, "target", 0.1, "measured", policy), tmp_path / "r.pt")
    code, out, err = run(capsys, *generate_args(model_dirs, "--router", str(path)))
    assert code == 0 and out.strip()
    assert "routed to draft:k=2 in" in err


def test_generate_with_a_missing_router(capsys, model_dirs, tmp_path):
    code, _, err = run(capsys, *generate_args(model_dirs, "--router", str(tmp_path / "no.pt")))
    assert code == 2 and "router artifact not found" in err and "Traceback" not in err


def test_router_train(capsys, tmp_path):
    data = make_collection(tmp_path / "data", max_new_tokens=6)
    out = tmp_path / "router.pt"
    code, text, err = run(capsys, "router", "train", str(data), "--out", str(out), "--epochs",
                          "2", "--hidden", "16", "--alpha", "0.3", "--limit", "4")
    assert code == 0, err
    assert "trained on 4 prompts" in text
    art = load_artifact(out)
    assert art.alpha == 0.3 and art.arm_names == ["ar", "ngram", "draft:k=2"]
    assert art.info["train"]["epochs"] == 2 and art.info["prompts"] == 4


def test_router_cv(capsys, tmp_path):
    data = make_collection(tmp_path / "data", max_new_tokens=6)
    out = tmp_path / "cv.json"
    code, text, err = run(capsys, "router", "cv", str(data), "--folds", "3", "--alphas", "0,1",
                          "--epochs", "2", "--hidden", "16", "--out", str(out))
    assert code == 0, err
    assert "3-fold cross-validation on 6 training prompts" in text
    rows = json.loads(out.read_text())
    assert [r["alpha"] for r in rows] == [0.0, 1.0]
    assert all(sum(r["picks"].values()) == 6 and r["speedup"] > 0 for r in rows)
    # train --alpha-cv: the alpha with the best cross-validated mean, the table in the artifact
    art_path = tmp_path / "router.pt"
    code, text, err = run(capsys, "router", "train", str(data), "--alpha-cv", "--folds", "3",
                          "--alphas", "0,1", "--epochs", "2", "--hidden", "16", "--out",
                          str(art_path))
    assert code == 0, err
    art = load_artifact(art_path)
    best = max(rows, key=lambda r: r["mean_speedup"])["alpha"]
    assert art.alpha == best and [r["alpha"] for r in art.info["cv"]] == [0.0, 1.0]
    assert "3-fold cross-validation" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["router", "train", "{tmp}"], "router collect"),
        (["router", "train", "{tmp}", "--epochs", "0"], "epochs"),
        (["router", "collect", "--arms", "ar"], "at least two arms"),
        (["router", "collect", "--max-new-tokens", "0"], "max-new-tokens"),
        (["router", "report", "--train", "{tmp}", "--bench", "{tmp}", "--features", "{tmp}",
          "--out", "{tmp}/r", "--alphas", "a,b"], "--alphas"),
        (["router", "cv", "{tmp}"], "router collect"),
    ],
)
def test_router_errors_are_one_line(capsys, tmp_path, argv, message):
    code, _, err = run(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2 and message in err and "Traceback" not in err


def test_router_model_options_come_from_the_shared_helper():
    """collect and features take the same model flags as generate and bench; features
    loads no draft whatever --draft says."""
    from adaspec.cli import build_parser
    from adaspec.store.catalog import TARGET_DEFAULT

    parser = build_parser()
    c = parser.parse_args(["router", "collect", "--weights", "int8-dyn", "--draft-weights",
                           "int4", "--dtype", "float32", "--no-progress"])  # fmt: skip
    assert (c.target, c.dtype, c.weights, c.draft_weights) == (
        TARGET_DEFAULT, "float32", "int8-dyn", "int4")  # fmt: skip
    assert c.no_progress
    f = parser.parse_args(["router", "features", "--suite", "wmt:1", "--out", "o"])
    assert f.draft is None and f.weights == "fastest" and not f.no_progress  # ik gives states
    with pytest.raises(SystemExit):
        parser.parse_args(["router", "collect", "--weights", "int3"])
