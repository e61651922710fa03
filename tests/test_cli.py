"""The command line: generate on tiny model directories, and one-line errors with exit 2."""

from __future__ import annotations

import pytest

from adaspec.cli import main


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def generate_args(model_dirs, *extra: str) -> list[str]:
    target, draft = model_dirs
    return ["generate", "def add(a, b):", "--target", target, "--draft", draft] + [
        "--dtype",
        "float32",
        "--raw",
        "--max-new-tokens",
        "12",
        *extra,
    ]


def greedy_text(model_dir: str, prompt: str, n: int) -> str:
    """Plain greedy decoding of the raw prompt, straight from Hugging Face (no adaspec)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.test_engine import reference_greedy

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    return tok.decode(reference_greedy(model, ids, n), skip_special_tokens=True)


def test_generate_prints_answer_and_one_stats_line(capsys, model_dirs):
    code, out, err = run(capsys, *generate_args(model_dirs, "--method", "draft:k=3"))
    assert code == 0
    assert out.rstrip("\n") == greedy_text(model_dirs[0], "def add(a, b):", 12)
    stats = [line for line in err.splitlines() if line.startswith("[draft:k=3]")]
    assert len(stats) == 1
    for field in ("12 new tokens", "tokens/s", "target calls", "MAT", "acceptance"):
        assert field in stats[0]


def test_stream_prints_the_same_text(capsys, model_dirs):
    _, plain, _ = run(capsys, *generate_args(model_dirs))
    _, streamed, _ = run(capsys, *generate_args(model_dirs, "--stream"))
    assert streamed == plain


def test_seeded_sampling_is_reproducible_from_the_cli(capsys, model_dirs):
    args = generate_args(model_dirs, "--temperature", "0.9", "--seed", "7", "--method", "ngram")
    assert run(capsys, *args)[1] == run(capsys, *args)[1]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--top-k", "-1"], "top_k must be an integer >= 0"),
        (["--method", "nope"], "unknown method 'nope'"),
        (["--max-new-tokens", "100000"], "context too long"),
        (["--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
        (["--target", "/no/such/model"], "/no/such/model"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, model_dirs, extra, message):
    code, _, err = run(capsys, *generate_args(model_dirs, *extra))
    assert code == 2
    lines = err.strip().splitlines()
    assert lines[-1].startswith("adaspec: error: ") and message in lines[-1]
    assert "Traceback" not in err


def test_empty_prompt_fails_before_loading_models(capsys):
    code, _, err = run(capsys, "generate", "  ", "--target", "/no/such/model")
    assert code == 2 and "prompt is empty" in err


def test_methods_lists_the_methods(capsys):
    code, out, _ = run(capsys, "methods")
    assert code == 0 and "ngram:" in out and "draft:" in out


def test_parsing_arguments_imports_no_model_library():
    """Every command's parser is built before anything runs (`--help`, a bad flag): it must
    not import transformers or rouge-score, which cost seconds."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from adaspec.cli import build_parser\n"
        "build_parser()\n"
        "print(sorted(m for m in ('transformers', 'rouge_score') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------- old option names and values (issue 32)
@pytest.mark.parametrize(
    ("argv", "weights", "draft_weights", "note"),
    [
        (["--quant", "int8"], "int8", "fastest", "--quant is deprecated; use --weights instead"),
        (["--draft-quant", "int4"], "fastest", "int4",
         "--draft-quant is deprecated; use --draft-weights instead"),
        (["--weights", "auto"], "fastest", "fastest",
         "weights 'auto' are now called 'fastest'"),
        (["--draft-weights", "auto"], "fastest", "fastest",
         "weights 'auto' are now called 'fastest'"),
    ],
)
def test_old_weights_options_and_value_still_work_with_a_one_line_note(
        capsys, argv, weights, draft_weights, note):
    """--quant / --draft-quant (the names before --weights) and the value `auto` (now
    `fastest`) still parse, to the new values, each with one line on stderr."""
    from adaspec.cli import build_parser

    args = build_parser().parse_args(["generate", "hi", *argv])
    assert (args.weights, args.draft_weights) == (weights, draft_weights)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and note in err, err


def test_old_option_with_the_old_value_says_both():
    import subprocess
    import sys

    code = ("from adaspec.cli import build_parser\n"
            "a = build_parser().parse_args(['bench', '--quant', 'auto'])\n"
            "print(a.weights)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "fastest"
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2 and "use --weights" in lines[1] and "'fastest'" in lines[0]


def test_the_old_options_are_hidden_from_help(capsys):
    from adaspec.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    out = capsys.readouterr().out
    assert "--weights {fastest,none,int8,int4,int8-dyn,gguf,ik,static}" in out
    assert "--draft-weights" in out and "--quant" not in out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--quant", "int3"])  # same choices


def test_a_library_caller_giving_weights_auto_is_told_the_new_name():
    from adaspec.backends.load import start_backend
    from adaspec.errors import InputError

    with pytest.raises(InputError, match="weights 'auto' are now called 'fastest'"):
        start_backend("/no/such/model", weights="auto")


def test_profile_measures_the_batch_cost_when_asked(capsys, model_dirs):
    target, _ = model_dirs
    code, out, err = run(capsys, "profile", "--target", target, "--no-draft", "--weights",
                         "static", "--batch", "4")
    assert code == 0, err
    table = out[out.index("batch cost of"):].splitlines()
    rows = [line.split("|")[1].strip() for line in table if line.startswith("| ") and
            line.split("|")[1].strip().isdigit()]
    assert rows == ["1", "2", "4"]  # sequences measured: up to the 4 asked
    assert "measuring the batch cost" in err
    again = run(capsys, "profile", "--target", target, "--no-draft", "--weights", "static",
                "--batch", "4")
    assert again[0] == 0 and "measuring the batch cost" not in again[2]  # read back
    code, _, err = run(capsys, "profile", "--target", target, "--no-draft", "--batch", "1")
    assert code == 2 and "at least 2" in err
