"""The device axis (`--device auto|cpu|cuda`): `auto` is the CPU where torch sees no GPU,
`cuda` without one is a one-line error naming what is missing (before any model loads), and
a CPU-only runtime asked for on a GPU is refused by name."""

from __future__ import annotations

import pytest

from adaspec.backends.device import CPU, cuda_missing, resolve_device
from adaspec.errors import InputError
from tests.test_cli import home, run  # noqa: F401 (home: autouse fixture)

no_gpu = pytest.mark.skipif(cuda_missing() is None, reason="a CUDA GPU is visible here")


@no_gpu
def test_auto_is_the_cpu_without_a_gpu():
    assert resolve_device("auto") == CPU
    assert resolve_device("cpu") == CPU


def test_an_unknown_device_is_named():
    with pytest.raises(InputError, match="unknown device 'tpu'"):
        resolve_device("tpu")


@no_gpu
@pytest.mark.parametrize("command", [
    ["generate", "hello"], ["serve"], ["profile"], ["bench", "--suite", "humaneval:1"]])
def test_cuda_without_a_gpu_is_one_line(capsys, command):
    code, _, err = run(capsys, *command, "--device", "cuda")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1, err
    assert "no CUDA GPU" in lines[0] and "--device cpu" in lines[0]
    assert "Traceback" not in err


def test_a_cpu_runtime_on_a_gpu_is_refused_before_loading():
    from adaspec.backends.load import start_backend

    with pytest.raises(InputError, match="--weights ik does not run on --device cuda"):
        start_backend("qwen2.5-coder-1.5b-instruct", weights="ik", device="cuda")


def test_ray_replicas_reserve_a_gpu_each_on_cuda(capsys):
    """`serve --ray` on a GPU: each replica reserves one GPU (Ray then shows it only its
    own); on the CPU none; GPUs asked for without a GPU, or without --ray, are refused."""
    from adaspec.cli import main
    from adaspec.serve.ray_app import actor_options

    assert actor_options(1.0, 1.0) == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert actor_options(0.5, 0.0) == {"num_cpus": 0.5}
    assert main(["serve", "--device", "cpu", "--gpus-per-replica", "1", "--ray"]) == 2
    assert main(["serve", "--device", "cpu", "--gpus-per-replica", "0"]) == 2
    err = capsys.readouterr().err
    assert "GPUs only with --device cuda" in err
    assert "--gpus-per-replica is a Ray Serve setting: add --ray" in err
