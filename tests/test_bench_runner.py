"""The bench runner on tiny fp32 models: rows, multi-turn prompts, resume after an
interruption, the exactness counter catching a broken method, and the CLI's early errors."""

from __future__ import annotations

import json

import pytest

from adaspec.cli import main
from adaspec.control.static import StaticLength
from adaspec.draft.model import ModelDrafter
from adaspec.engine.loop import Engine
from adaspec.errors import InputError
from adaspec.lab.bench.runner import BenchConfig, BenchRunner, read_rows
from adaspec.lab.bench.suites import Prompt
from adaspec.verify.base import Verdict, Verifier

PROMPTS = [
    Prompt("t/0", "code", "def add(a, b):"),
    Prompt("t/1", "code", "for i in range(10):"),
    Prompt("t/2", "chat", "class point:", turns=("class point:", "def fibonacci(n):")),
]


class AcceptEverything(Verifier):
    """A wrong verifier: keeps every drafted token, whatever the target says."""

    name = "accept-all"

    def verify(self, proposal, target_probs, generator):
        k = proposal.depth
        return Verdict(list(range(1, k + 1)), int(target_probs[k].argmax()))


def make_runner(tmp_path, target, draft, tokenizer, methods, engines=None, **kw):
    config = BenchConfig(
        methods=methods,
        suites=["test"],
        max_new_tokens=kw.pop("max_new_tokens", 10),
        out=str(tmp_path / "out"),
        **kw,
    )
    return BenchRunner(
        config, target, tokenizer, draft, eos_token_ids=[0], engines=engines, progress=False
    )


def test_runner_rows_summary_and_plots(tmp_path, target, draft, tokenizer):
    runner = make_runner(
        tmp_path, target, draft, tokenizer, ["ngram:k=4", "draft:k=3", "hf-assisted"]
    )
    summary = runner.run(PROMPTS)
    out = tmp_path / "out"
    rows, broken = read_rows(out / "results.jsonl")
    assert broken == 0
    assert len(rows) == len(PROMPTS) * 4
    assert {(r["prompt_id"], r["method"]) for r in rows} == {
        (p.id, m) for p in PROMPTS for m in ("ar", "ngram:k=4", "draft:k=3", "hf-assisted")
    }
    # fp32 tiny models: every method reproduces plain decoding exactly
    assert summary["exactness"] == {
        "tie_tolerance": 0.125,
        "checked": 9,
        "differs": 0,
        "numerical_ties": 0,
        "bugs": 0,
        "divergences": [],
    }
    by = {(r["prompt_id"], r["method"]): r for r in rows}
    two_turns = by[("t/2", "draft:k=3")]
    assert len(two_turns["turn_tokens"]) == 2 and sum(two_turns["turn_tokens"]) == len(
        two_turns["token_ids"]
    )
    assert two_turns["token_ids"] == by[("t/2", "ar")]["token_ids"]
    ar = by[("t/0", "ar")]
    assert ar["target_calls"] == ar["new_tokens"] and ar["oracle"]["new_tokens"] == ar["new_tokens"]
    hf = by[("t/0", "hf-assisted")]
    assert hf["draft_calls"] > 0 and hf["drafted"] >= hf["accepted"] and hf["steps"]
    assert set(summary["categories"]) == {"code", "chat"}
    assert summary["methods"]["ar"]["speedup"] == pytest.approx(1.0)
    for m in ("draft:k=3", "hf-assisted"):
        assert summary["theory"][m]["oracle_mat"] >= 1.0
    assert "ngram:k=4" not in summary["theory"]
    for name in ("summary.json", "summary.md", "run.json", *summary["plots"]):
        assert (out / name).is_file()
    assert set(summary["plots"]) == {
        "speedup_by_category.png",
        "acceptance_by_position.png",
        "mat_histogram.png",
    }
    assert json.loads((out / "summary.json").read_text())["methods"].keys() == {
        "ar",
        "ngram:k=4",
        "draft:k=3",
        "hf-assisted",
    }


class Interrupt(Exception):
    pass


def test_resume_after_interruption_gives_one_row_per_prompt_method_repeat(
    tmp_path, target, draft, tokenizer, monkeypatch
):
    methods = ["ngram:k=4", "draft:k=2"]
    runner = make_runner(tmp_path, target, draft, tokenizer, methods, repeats=2)
    calls = {"n": 0}
    real = BenchRunner.run_prompt

    def dying(self, method, prompt, repeat):
        calls["n"] += 1
        if calls["n"] == 8:
            raise Interrupt  # killed in the middle of the run
        return real(self, method, prompt, repeat)

    monkeypatch.setattr(BenchRunner, "run_prompt", dying)
    with pytest.raises(Interrupt):
        runner.run(PROMPTS)
    results = tmp_path / "out" / "results.jsonl"
    first, _ = read_rows(results)
    # 7 runs finished, but the 7th (t/1's draft:k=2, first in that prompt's rotated order)
    # waits for its plain-decoding reference: it is not written, and resuming runs it again
    assert len(first) == 6
    with results.open("a") as f:
        f.write('{"prompt_id": "t/1", "method": "dra')  # a row cut off mid-write
    monkeypatch.setattr(BenchRunner, "run_prompt", real)

    # Without --resume the old results are not mixed with a new run.
    with pytest.raises(InputError, match="--resume"):
        make_runner(tmp_path, target, draft, tokenizer, methods, repeats=2).run(PROMPTS)
    # Resuming with other settings would mix incomparable rows.
    with pytest.raises(InputError, match="max_new_tokens was 10, now 12"):
        make_runner(
            tmp_path, target, draft, tokenizer, methods, repeats=2, resume=True, max_new_tokens=12
        ).run(PROMPTS)

    summary = make_runner(tmp_path, target, draft, tokenizer, methods, repeats=2, resume=True).run(
        PROMPTS
    )
    rows, broken = read_rows(results)
    assert broken == 0
    keys = [(r["prompt_id"], r["method"], r["repeat"]) for r in rows]
    assert len(keys) == len(set(keys)) == len(PROMPTS) * 3 * 2
    assert rows[:6] == first  # written rows were kept, not re-run
    assert summary["methods"]["ar"]["prompts"] == len(PROMPTS) * 2
    assert summary["exactness"]["bugs"] == 0

    # --overwrite starts over
    again = make_runner(tmp_path, target, draft, tokenizer, ["ar"], overwrite=True)
    again.run(PROMPTS[:1])
    assert len(read_rows(results)[0]) == 1


@pytest.mark.parametrize("order", ["rotate", "fixed"])
def test_method_order_rotates_per_prompt(tmp_path, target, draft, tokenizer, order):
    methods = ["ngram:k=4", "draft:k=2"]
    runner = make_runner(tmp_path, target, draft, tokenizer, methods, method_order=order)
    summary = runner.run(PROMPTS)
    rows, _ = read_rows(tmp_path / "out" / "results.jsonl")
    ran = [[r["method"] for r in rows if r["prompt_id"] == p.id] for p in PROMPTS]
    full = ["ar", *methods]
    if order == "fixed":
        assert ran == [full] * 3
    else:  # each prompt starts one further along; rows run before `ar` were still checked
        assert ran == [full, [*full[1:], "ar"], [full[2], "ar", full[1]]]
    assert all(r["exactness_checked"] and r["divergence"] is None for r in rows
               if r["method"] != "ar")
    assert summary["methods"]["ngram:k=4"]["differs_from_ar"] == 0


def test_exactness_counter_catches_a_broken_method(tmp_path, target, draft, tokenizer):
    broken = Engine(
        target,
        tokenizer,
        drafter=ModelDrafter(draft),
        controller=StaticLength(3),
        verify=AcceptEverything(),
        eos_token_ids=[0],
    )
    messages: list[str] = []
    config = BenchConfig(
        methods=["draft:k=3", "broken"], max_new_tokens=12, out=str(tmp_path / "out")
    )
    runner = BenchRunner(
        config,
        target,
        tokenizer,
        draft,
        eos_token_ids=[0],
        engines={"broken": broken},
        progress=False,
        log=messages.append,
    )
    summary = runner.run(PROMPTS[:2])
    ex = summary["exactness"]
    # on t/1 `broken` runs before `ar` (rotated order): it is checked once `ar` has run
    assert ex["bugs"] == 2 and ex["numerical_ties"] == 0
    assert {d["prompt_id"] for d in ex["divergences"]} == {"t/0", "t/1"}
    assert all(d["method"] == "broken" for d in ex["divergences"])
    assert summary["methods"]["draft:k=3"]["differs_from_ar"] == 0
    assert any("EXACTNESS" in m and "t/0" in m and "BUG" in m for m in messages)
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "2 BUG(S)" in md and "| t/1 | `broken` |" in md


def test_sampling_runs_skip_exactness_and_theory(tmp_path, target, draft, tokenizer):
    runner = make_runner(
        tmp_path, target, draft, tokenizer, ["draft:k=3"], temperature=0.8, top_p=0.9, seed=3
    )
    summary = runner.run(PROMPTS[:2])
    assert summary["exactness"]["checked"] == 0 and summary["theory"] == {}
    assert "not compared token by token" in (tmp_path / "out" / "summary.md").read_text()


def test_runner_refuses_a_draft_method_without_a_draft(tmp_path, target, tokenizer):
    with pytest.raises(InputError, match="needs a draft model"):
        make_runner(tmp_path, target, None, tokenizer, ["draft:k=2"])


# ----------------------------------------------------------------------------- CLI


@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "question.jsonl"
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["def add(a, b):", "class Point:"]},
        {"question_id": 2, "category": "qa", "turns": ["for i in range(10):"]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_cli_bench_end_to_end(tmp_path, capsys, model_dirs, questions, monkeypatch):
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    target, draft = model_dirs
    out = tmp_path / "res"
    argv = ["bench", "--questions", str(questions), "--methods", "ar,draft:k=3,hf-assisted"]
    argv += ["--target", target, "--draft", draft, "--dtype", "float32", "--no-progress"]
    argv += ["--max-new-tokens", "8", "--out", str(out)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "## Overall" in captured.out and "memory bandwidth" in captured.err
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["categories"]) == {"mt-bench", "qa"}
    assert summary["bandwidth"]["copy_gbs"] > 0 and summary["bandwidth"]["gemv_gbs"] > 0
    assert summary["exactness"]["bugs"] == 0
    # a second run into the same folder needs --resume (checked before loading models)
    assert main(argv) == 2
    assert "--resume" in capsys.readouterr().err
    rows = (out / "results.jsonl").read_text()
    assert len(rows.splitlines()) == 2 * 3  # one row per (prompt, method), turns summed
    assert main([*argv, "--resume"]) == 0
    assert (out / "results.jsonl").read_text() == rows  # a finished run: nothing runs again


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--questions", "/nonexistent/q.jsonl"], "/nonexistent/q.jsonl"),
        (["bench", "--methods", "ar,medusa"], "unknown method 'medusa'"),
        (["bench", "--suite", "mmlu"], "unknown suite 'mmlu'"),
        (["bench", "--temperature", "-1"], "temperature must be >= 0"),
        (["bench", "--suite", "spec-bench:x"], "must be an integer"),
        (["generate", "hi", "--method", "hf-assisted"], "only `adaspec bench` runs"),
    ],
)
def test_cli_errors_are_one_line_before_loading_models(capsys, argv, message, monkeypatch):
    import adaspec.store.model_store as store

    def no_loading(*a, **k):
        raise AssertionError("models must not load")

    monkeypatch.setattr(store, "load_model", no_loading)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


# ------------------------------------------------------------------ reference methods
def test_reference_methods_parse_only_for_the_bench():
    from adaspec.lab.bench.references import REFERENCE_METHODS, parse_bench_method
    from adaspec.methods.spec import describe_methods, parse_method

    spec = parse_bench_method("hf-assisted-constant:k=3")
    assert spec.is_reference and spec.needs_draft_model() and spec["k"] == 3
    assert parse_bench_method("hf-assisted").settings() == {"cache": "static"}
    assert parse_bench_method("hf-lookup").settings() == {"cache": "static", "k": 10, "n_max": 2}
    assert not parse_bench_method("hf:cache=dynamic").needs_draft_model()
    with pytest.raises(InputError, match="cache must be one of static | dynamic"):
        parse_bench_method("hf:cache=paged")
    with pytest.raises(InputError, match="unknown method 'hf-assisted'"):
        parse_method("hf-assisted")  # the runtime's parser knows adaspec methods only
    with pytest.raises(InputError, match="k must be >= 1"):
        parse_bench_method("hf-assisted-constant:k=0")
    assert "hf-assisted-constant:" in describe_methods(REFERENCE_METHODS)


def test_steps_from_hooked_calls():
    from adaspec.lab.bench.hf_reference import steps_from_calls

    # prompt of 5; call 0 feeds prompt + 3 drafts and keeps 2 (+1 target token), call 1
    # feeds last + 3 and keeps all (+1), call 2 feeds last + 2 and the run ends 2 tokens later.
    calls = [(8, 0, 0.1), (4, 7, 0.1), (3, 11, 0.1)]
    assert steps_from_calls(calls, prompt_len=5, new_tokens=9) == [(3, 2), (3, 3), (2, 1)]


def test_hf_assisted_settings_do_not_leak(target_model, draft_model):
    from adaspec.lab.bench.hf_reference import hf_generate

    before = draft_model.generation_config.to_dict()
    ref, _ = hf_generate(target_model, [3, 4, 5], 10, [0])
    out, stats = hf_generate(
        target_model, [3, 4, 5], 10, [0], draft_model, num_assistant_tokens=2, schedule="constant"
    )
    assert out == ref and all(d <= 2 for d, _ in stats.steps)
    assert stats.target_calls >= 1 and stats.draft_calls == stats.drafted
    assert draft_model.generation_config.to_dict() == before


def test_hugging_face_peers_plain_and_prompt_lookup(tmp_path, target_model, draft, tokenizer,
                                                    monkeypatch):
    """`hf` and `hf-lookup` run HF's generate on the target's weights: greedy output equal to
    plain decoding, prompt lookup verifying drafts. Where HF's static cache fails (prompt
    lookup overran it in transformers 5.24; simulated here, as whether it overruns depends on
    the prompt), the run falls back to the dynamic cache and says so. On a run whose target
    is the static runtime (a GPU's default), HF runs the same checkpoint's plain weights,
    loaded as a variant."""
    import adaspec.lab.bench.runner as runner_module
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.backends.torch.static import static_backend

    real = runner_module.hf_generate

    def overruns_static_lookup(*args, **kwargs):
        if kwargs.get("lookup") and kwargs.get("cache") == "static":
            raise IndexError("index_copy_(): index 30 is out of bounds for dimension 2")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_module, "hf_generate", overruns_static_lookup)
    loaded = []

    def load_variant(role, weights):
        loaded.append((role, weights))
        return TorchBackend(target_model, name="tiny-target")

    config = BenchConfig(methods=["hf", "hf-lookup:k=4", "ngram:k=4"], suites=["test"],
                         max_new_tokens=24, out=str(tmp_path / "out"), weights="static")
    runner = BenchRunner(config, static_backend(target_model, "tiny-target"), tokenizer, draft,
                         eos_token_ids=[0], progress=False, load_variant=load_variant)
    prompts = [Prompt("t/0", "code", "abcabcabcabcabc abcabc"), PROMPTS[1]]
    summary = runner.run(prompts)
    assert loaded == [("target", "none")]  # one plain copy for both HF methods
    rows, _ = read_rows(tmp_path / "out" / "results.jsonl")
    by = {(r["prompt_id"], r["method"]): r for r in rows}
    for p in prompts:
        ar = by[(p.id, "ar")]["token_ids"]
        assert by[(p.id, "hf")]["token_ids"] == ar
        assert by[(p.id, "hf-lookup:k=4")]["token_ids"] == ar
    assert by[("t/0", "hf-lookup:k=4")]["drafted"] > 0
    # another runtime than the run's own target: compared with plain decoding, not checked
    assert by[("t/0", "hf")]["other_weights"] and not by[("t/0", "hf")]["exactness_checked"]
    assert by[("t/0", "hf")]["other_runtime"]  # the same weights, said so in the report
    report = (tmp_path / "out" / "summary.md").read_text()
    assert "`hf` runs another runtime (transformers' kernels on the same checkpoint's" in report
    assert by[("t/0", "ngram:k=4")]["exactness_checked"]
    assert summary["exactness"]["bugs"] == 0
    peers = summary["peers"]
    assert peers["hf"]["cache"] == "static" and "fallback" not in peers["hf"]
    assert peers["hf-lookup:k=4"]["cache"] == "dynamic"
    assert "static cache failed" in peers["hf-lookup:k=4"]["fallback"]
    assert json.loads((tmp_path / "out" / "run.json").read_text())["peers"] == peers
    # the loop's own time beside the target's, per decode step, for adaspec's methods
    ngram = by[("t/0", "ngram:k=4")]
    assert ngram["target_ms_per_step"] > 0 and ngram["loop_ms_per_step"] >= 0
    assert "target_ms_per_step" not in by[("t/0", "hf")]


def test_hf_warms_up_at_two_lengths(tmp_path, tokenizer, target_model, monkeypatch):
    """HF's static cache is compiled per length on a GPU: its warm-up runs two lengths, so
    the recompile for any length happens there, not in the first measured prompt; an
    adaspec engine warms up once."""
    import adaspec.lab.bench.runner as runner_module
    from adaspec.backends.torch.backend import TorchBackend

    calls = []
    real = runner_module.BenchRunner._generate

    def counting(self, m, ids, max_new_tokens, *args, **kwargs):
        calls.append((m, len(ids), max_new_tokens))
        return real(self, m, ids, max_new_tokens, *args, **kwargs)

    monkeypatch.setattr(runner_module.BenchRunner, "_generate", counting)
    config = BenchConfig(methods=["hf"], suites=["test"], max_new_tokens=8,
                         out=str(tmp_path / "out"))
    runner = BenchRunner(config, TorchBackend(target_model, name="tiny-target"), tokenizer,
                         None, eos_token_ids=[0], progress=False)
    runner.warm_up(PROMPTS[0])
    hf = [(n, t) for m, n, t in calls if m == "hf"]
    assert len(hf) == 2 and hf[0][0] != hf[1][0] and hf[0][1] != hf[1][1]
    assert [m for m, _, _ in calls].count("ar") == 1


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_hf_assisted_counts_what_it_accepted(target_model, cache):
    """The target as its own assistant: every drafted token is accepted, with either cache
    (the cache length comes from the fed positions: a static cache's own length counts every
    slot ever written, rollbacks included)."""
    import copy

    from adaspec.lab.bench.hf_reference import hf_generate

    twin = copy.deepcopy(target_model)  # the same weights, its own hooks
    out, stats = hf_generate(target_model, [3, 4, 5, 3, 4, 5], 16, [0], twin,
                             num_assistant_tokens=3, schedule="constant", cache=cache)
    assert stats.drafted > 0 and stats.accepted == stats.drafted
