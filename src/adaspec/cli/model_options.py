"""The model options every command shares: which target and draft, in which dtype, with which
weights (a torch weight quantization, a llama.cpp runtime, or the fastest this machine has)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from adaspec.backends.device import AUTO, DEVICES
from adaspec.backends.weights import FASTEST, OLD_FASTEST, WEIGHTS_CHOICES
from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT
from adaspec.store.loading import DTYPES

WEIGHTS_HELP = (
    "weights: fastest (default: the fastest for the device: ik > gguf > none on a CPU, static "
    "on a GPU), none (bf16 torch), static (bf16, adaspec's static-KV-cache torch runtime), "
    "int8 / int4 weight-only, int8-dyn (int8 weights and per-token int8 activations), gguf "
    "(the model's GGUF run by llama.cpp, chains only; the llamacpp extra) or ik (the GGUF run "
    "by ik_llama.cpp with repacked weights; token trees on its native build)"
)
# The options' names before issue 32 (they named the runtime too, not only a quantization):
# still accepted, hidden from --help, with a one-line note.
OLD_OPTIONS = {"--quant": "--weights", "--draft-quant": "--draft-weights"}


def weights_value(text: str) -> str:
    """argparse type of --weights: the old value `auto` is `fastest`, with a one-line note."""
    if text == OLD_FASTEST:
        print(f"adaspec: weights {OLD_FASTEST!r} are now called {FASTEST!r}; "
              f"give {FASTEST!r} instead", file=sys.stderr)
        return FASTEST
    return text


class _OldOption(argparse.Action):
    """An option's name before a rename: stores into the new option's dest and says so."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        print(f"adaspec: {option_string} is deprecated; use {OLD_OPTIONS[str(option_string)]} "
              "instead", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_model_options(
    p: argparse.ArgumentParser,
    draft: bool = True,
    weights: bool = True,
    default_from: str | None = None,
    default_weights: str = FASTEST,
    device: bool = False,
) -> None:
    """--target, --draft, --dtype, --weights and --draft-weights, defined once for every
    command.

    draft=False leaves out the draft's two flags. Commands that read a trained artifact pass
    default_from (what names the pair, e.g. "the artifact"): --target and --draft then
    default to None, meaning that pair; weights=False leaves out --weights / --draft-weights
    for commands that take the weights from such a file too. default_weights: the weights
    when --weights is not given (`fastest`: the fastest this machine has). The old names
    --quant / --draft-quant set the same values (hidden, with a one-line note).
    device=True adds --device (where the models run: auto, cpu or cuda)."""
    where = "built-in model name, HF model directory or .gguf path"
    defaults: tuple[str | None, str | None]
    if default_from is None:
        defaults = (TARGET_DEFAULT, DRAFT_DEFAULT)
    else:
        defaults = (None, None)
        where += f" (default: the one {default_from} names)"
    p.add_argument("--target", default=defaults[0], help=f"target: {where}")
    if draft:
        p.add_argument("--draft", default=defaults[1], help=f"draft model: {where}")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    if weights:
        roles = [("--weights", "weights", f"target {WEIGHTS_HELP}")]
        if draft:
            roles.append(("--draft-weights", "draft_weights",
                          "draft weights (same choices as --weights)"))
        for flag, dest, help_ in roles:
            p.add_argument(flag, dest=dest, default=default_weights, type=weights_value,
                           choices=WEIGHTS_CHOICES, help=help_)
            old = next(o for o, new in OLD_OPTIONS.items() if new == flag)
            p.add_argument(old, dest=dest, type=weights_value, choices=WEIGHTS_CHOICES,
                           action=_OldOption, help=argparse.SUPPRESS)
    if device:
        p.add_argument("--device", default=AUTO, choices=list(DEVICES),
                       help="where the models run: auto (default: a CUDA GPU when torch sees "
                            "one, else the CPU), cpu, or cuda (torch weights on the GPU)")
