"""The router report end to end on tiny models: collect, train, bench the router beside its
arms, record test states, report (tables, learning curve, alpha sweep, plots)."""

from __future__ import annotations

import json

import pytest

from adaspec.errors import InputError
from adaspec.lab.bench.runner import BenchConfig, BenchRunner
from adaspec.lab.router.collect import record_states
from adaspec.lab.router.collection import load_collection
from adaspec.lab.router.router_report import RETRAINED, label, to_markdown, write_report
from adaspec.lab.router.train_policy import train_artifact
from adaspec.methods.build import build_generator
from adaspec.route.artifact import save_artifact
from adaspec.route.policy import TrainConfig
from tests.route_helpers import ARMS, TEST, backends, make_collection

SMALL = TrainConfig(epochs=3, hidden=16)


def test_report_end_to_end(tmp_path):
    train_dir = make_collection(tmp_path / "train")
    art = train_artifact(load_collection(train_dir), 0.1, "measured", SMALL)
    path = save_artifact(art, tmp_path / "router.pt")
    target, tok, draft = backends()
    routers = [f"router:{path}", f"router:{path},mode=dynamic"]
    bench = tmp_path / "bench"
    runner = BenchRunner(
        BenchConfig(methods=[*ARMS, *routers], max_new_tokens=10, out=str(bench)),
        target, tok, draft, eos_token_ids=[], progress=False,
    )
    summary = runner.run(TEST)
    assert summary["exactness"]["bugs"] == 0 and summary["exactness"]["differs"] == 0
    rows = [json.loads(x) for x in (bench / "results.jsonl").read_text().splitlines()]
    assert all(r["route"][0] in ARMS for r in rows if r["method"] in routers)
    record_states(TEST, build_generator("ar", target, tok, None, []), tmp_path / "features",
                  progress=False)

    out = write_report(str(train_dir), str(bench), str(tmp_path / "features"),
                       str(tmp_path / "report"), SMALL, "measured", None, [0.0, 1.0], 2)
    rep = json.loads((out / "report.json").read_text())
    assert rep["routers"] == routers and rep["test_prompts"] == len(TEST)
    assert set(rep["speedup"]["overall"]) == {*ARMS, *routers, "oracle router",
                                               "router greedy (replayed)"}
    assert rep["speedup"]["overall"]["ar"] == pytest.approx(1.0)
    assert [p["prompts"] for p in rep["learning_curve"]] == [2, 4, 6]
    assert {(s["cost"], s["alpha"]) for s in rep["alpha_sweep"]} == {
        ("measured", 0.0), ("measured", 1.0), ("params", 0.0), ("params", 1.0)
    }
    assert sum(rep["routes"][routers[0]].values()) == len(TEST)  # one pick per request
    md = (out / "report.md").read_text()
    assert "oracle router" in md and md == to_markdown(rep)
    for png in ("speedup_by_category.png", "learning_curve.png", "alpha_sweep.png"):
        assert (out / png).stat().st_size > 1000
    # both scopes in the learning curve and the sweep; the last curve point is the policy the
    # sweep trains at the same alpha (here: the artifact's settings, so the replayed row)
    for p in [*rep["learning_curve"], *rep["alpha_sweep"]]:
        assert p["mean_speedup"] is not None and p["speedup"] is not None
    replayed = rep["speedup"]["overall"]["router greedy (replayed)"]
    assert rep["learning_curve"][-1]["speedup"] == pytest.approx(replayed)
    # the live greedy router picks what the replayed policy picks (same prompt states)
    assert rep["replayed_picks"] == rep["routes"][routers[0]] and rep["retrained_picks"] is None
    # timing noise: every live router run repeats its arm's own run (single-turn prompts)
    assert rep["timing_noise"]["pairs"] == 2 * len(TEST)
    assert "## Timing noise" in md
    # an artifact trained with --alpha-cv carries its cross-validation table into the report
    assert "cross-validation" not in md
    rep["artifact"]["info"]["cv"] = [{"alpha": 0.0, "folds": 3, "mean_speedup": 1.2,
                                      "speedup": 1.1, "fastest_share": 0.5, "picks": {"ar": 6}}]
    assert "3-fold cross-validation on the training prompts" in to_markdown(rep)

    # other training settings than the artifact's (the paper's epochs): a retrained row
    other = write_report(str(train_dir), str(bench), str(tmp_path / "features"),
                         str(tmp_path / "report-other"), TrainConfig(epochs=1, hidden=16),
                         "measured", None, [0.1], 1)
    rep2 = json.loads((other / "report.json").read_text())
    assert RETRAINED in rep2["speedup"]["overall"] and rep2["retrained_picks"] is not None
    assert sum(rep2["retrained_picks"].values()) == len(TEST)
    assert rep2["learning_curve"][-1]["speedup"] == pytest.approx(
        rep2["speedup"]["overall"][RETRAINED]
    )


def test_plot_labels_tell_the_routers_apart():
    long = "router:benchmarks/results/router/some-long-folder-name/router.pt"
    assert label(long) == "router:router.pt"
    assert label(long + ",mode=dynamic") == "router:router.pt,mode=dynamic"
    assert label("draft:ctrl=heuristic,k=4") == "draft:ctrl=heuristic,k=4"


def test_report_needs_router_rows(tmp_path):
    train_dir = make_collection(tmp_path / "train", max_new_tokens=4)
    with pytest.raises(InputError, match="no router:ARTIFACT rows"):
        write_report(str(train_dir), str(train_dir / "runs"), str(train_dir), str(tmp_path / "r"),
                     SMALL, "measured", None, [0.5], 1)
