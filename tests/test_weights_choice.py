"""The runtime `fastest` picks, the shared-tokenizer shortcut, and numpy's argmax stand-in."""

from __future__ import annotations

import pytest
import torch

from adaspec.backends import weights
from adaspec.backends.runtimes import fastest_weights
from adaspec.core.sampling import argmax
from adaspec.store.loading import same_vocabulary_files


def test_a_model_without_a_gguf_runs_on_torch(model_dirs):
    target, _ = model_dirs
    assert fastest_weights(target) == "none"


@pytest.mark.parametrize(
    "ik, llama, expected", [(True, True, "ik"), (False, True, "gguf"), (False, False, "none")]
)
def test_a_builtin_model_gets_the_fastest_runtime_installed(monkeypatch, ik, llama, expected):
    import adaspec.backends.ik.backend as ikllama

    monkeypatch.setattr(ikllama, "available", lambda: ik)
    monkeypatch.setattr(weights, "llama_cpp_installed", lambda: llama)
    assert fastest_weights("qwen2.5-coder-1.5b-instruct") == expected


def test_on_a_gpu_fastest_is_torch_and_cpu_runtimes_are_refused(monkeypatch):
    """The registry: only torch in the model's dtype runs on cuda, whatever is installed."""
    import adaspec.backends.ik.backend as ikllama
    from adaspec.backends.runtimes import fastest_weights, runtime_for
    from adaspec.errors import InputError

    monkeypatch.setattr(ikllama, "available", lambda: True)
    assert fastest_weights("qwen2.5-coder-1.5b-instruct", "cuda") == "static"
    assert fastest_weights("qwen2.5-coder-1.5b-instruct", "cpu") == "ik"
    assert runtime_for("none", "cuda").name == "torch"
    assert runtime_for("static", "cpu").name == "torch-static"
    assert runtime_for("ik", "cpu").name == "ik_llama.cpp"
    for variant in ("ik", "gguf", "int8"):
        with pytest.raises(InputError, match=f"--weights {variant} does not run on --device "
                                             "cuda; there: static, none"):
            runtime_for(variant, "cuda")


def test_threads_follow_the_environment(monkeypatch):
    monkeypatch.setenv("ADASPEC_THREADS", "3")
    assert weights.llama_threads() == 3


def test_same_vocabulary_files(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert not same_vocabulary_files(a, b)  # no tokenizer files at all
    for folder in (a, b):
        (folder / "tokenizer.json").write_text('{"v": 1}')
        (folder / "chat_template.jinja").write_text(f"template of {folder.name}")
    assert same_vocabulary_files(a, b)  # a chat template does not change token ids
    (b / "tokenizer.json").write_text('{"v": 2}')
    assert not same_vocabulary_files(a, b)
    (b / "tokenizer.json").write_text('{"v": 1}')
    (a / "tokenizer_config.json").write_text("{}")
    assert not same_vocabulary_files(a, b)  # a file on one side only


def test_argmax_matches_torch_with_first_index_on_ties():
    x = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, -1.0, 0.0]])
    assert argmax(x).tolist() == x.argmax(-1).tolist() == [1, 0]
    row = torch.randn(151936)
    assert int(argmax(row)) == int(row.argmax())
    assert argmax(x.to(torch.bfloat16)).tolist() == [1, 0]
