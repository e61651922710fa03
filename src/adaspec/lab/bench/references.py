"""The bench's reference methods: what users already run, measured beside adaspec's methods
on the same prompts. Hugging Face assisted generation runs the same loaded models; llama.cpp
(llama-cpp-python) plain and speculative decoding run the target's GGUF. They are not
adaspec engines, so they live in the lab's own registry and only `adaspec bench` parses them
(`parse_bench_method`)."""

from __future__ import annotations

from dataclasses import dataclass

from adaspec.methods.params import NoParams, check, param
from adaspec.methods.registry import Method
from adaspec.methods.spec import MethodSpec, parse_method
from adaspec.registry import Registry


@dataclass(frozen=True)
class ConstantParams:
    k: int = param(5, "assistant tokens per step (constant schedule)")

    def __post_init__(self) -> None:
        check(self.k >= 1, "k must be >= 1")


@dataclass(frozen=True)
class LookupParams:
    k: int = param(4, "tokens to propose per step (LlamaPromptLookupDecoding's num_pred_tokens)")
    n_max: int = param(
        2, "longest n-gram to match (its max_ngram_size; 2 is llama-cpp-python's default)"
    )

    def __post_init__(self) -> None:
        check(self.k >= 1, "k must be >= 1")
        check(self.n_max >= 1, "n_max must be >= 1")


@dataclass(frozen=True)
class GgufDraftParams:
    k: int = param(4, "tokens the draft GGUF proposes per step")

    def __post_init__(self) -> None:
        check(self.k >= 1, "k must be >= 1")


def _draft(params: object) -> bool:
    return True


REFERENCE_METHODS: Registry[Method] = Registry("reference method")
for _method in (
    Method("hf-assisted", "[bench only] HF generate(assistant_model=draft), its default "
           "schedule", NoParams, None, needs_draft=_draft, reference=True),
    Method("hf-assisted-constant", "[bench only] Hugging Face assisted generation, constant k "
           "tokens", ConstantParams, None, needs_draft=_draft, reference=True),
    Method("llamacpp", "[bench only] greedy decoding of the target's GGUF by llama-cpp-python "
           "(other weights: compared for quality, not exactness; extra adaspec[llamacpp])",
           NoParams, None, reference=True, other_weights=True),
    Method("llamacpp-lookup", "[bench only] llama-cpp-python's prompt-lookup decoding "
           "(LlamaPromptLookupDecoding as Llama(draft_model=...), its own generate loop) on "
           "the target's GGUF, greedy (other weights, like llamacpp)", LookupParams, None,
           reference=True, other_weights=True),
    Method("llamacpp-draft", "[bench only] llama-cpp-python's speculative loop with the "
           "draft's GGUF as its draft model (greedy, k tokens per step) on the target's GGUF "
           "(other weights, like llamacpp)", GgufDraftParams, None, reference=True,
           other_weights=True),
):
    REFERENCE_METHODS.register(_method.name, _method)


def parse_bench_method(text: str) -> MethodSpec:
    """A method the bench can run: any adaspec method, or a reference method."""
    return parse_method(text, extra=REFERENCE_METHODS)
