"""The bench's reference methods: what users already run, measured beside adaspec's methods
on the same prompts. Hugging Face assisted generation runs the same loaded models; llama.cpp
(llama-cpp-python) plain and speculative decoding, and llama.cpp's own `llama-server` (a native
build, driven over HTTP), run the target's GGUF. They are not adaspec engines, so they live in
the lab's own registry and only `adaspec bench` parses them (`parse_bench_method`)."""

from __future__ import annotations

from dataclasses import dataclass

import adaspec.lab.bench.oracle  # noqa: F401  (registers ctrl=oracle, the bench's controller)
from adaspec.methods.base import Method
from adaspec.methods.params import NoParams, check, param
from adaspec.methods.spec import MethodSpec, parse_method
from adaspec.registry import Registry

HF_CACHES = ("static", "dynamic")  # the KV caches of HF's generate (lab.bench.hf_reference)


@dataclass(frozen=True)
class HfParams:
    cache: str = param("static", "the KV cache HF's generate keeps: static (preallocated, as "
                       "its users run it on a GPU) or dynamic (its default)")

    def __post_init__(self) -> None:
        check(self.cache in HF_CACHES, f"cache must be one of {' | '.join(HF_CACHES)}")


@dataclass(frozen=True)
class ConstantParams(HfParams):
    k: int = param(5, "assistant tokens per step (constant schedule)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.k >= 1, "k must be >= 1")


@dataclass(frozen=True)
class HfLookupParams(HfParams):
    k: int = param(10, "tokens proposed per step (prompt_lookup_num_tokens; HF's documented "
                   "example value)")
    n_max: int = param(2, "longest n-gram to match (max_matching_ngram_size; HF's default)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.k >= 1, "k must be >= 1")
        check(self.n_max >= 1, "n_max must be >= 1")


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


# llama-server's --spec-type values the bench runs (lab.bench.llama_server.SPEC_TYPES; kept
# here too so parsing a method string imports no server code).
SERVER_SPECS = ("none", "ngram-simple", "ngram-mod", "ngram-map-k", "ngram-map-k4v",
                "draft-simple")


@dataclass(frozen=True)
class ServerParams:
    spec: str = param("none", "llama-server --spec-type: " + " | ".join(SERVER_SPECS)
                      + " (each with its stock settings; draft-simple runs the draft's GGUF)")
    n_max: int = param(8, "draft-simple: --spec-draft-n-max, the most tokens drafted per step")
    p_min: float = param(0.75, "draft-simple: --spec-draft-p-min, drafting stops below this "
                         "draft probability")

    def __post_init__(self) -> None:
        check(self.spec in SERVER_SPECS,
              f"unknown spec {self.spec!r}; use one of {' | '.join(SERVER_SPECS)}")
        check(self.n_max >= 1, "n_max must be >= 1")
        check(0.0 <= self.p_min <= 1.0, "p_min must be within [0, 1]")


def _draft(params: object) -> bool:
    return True


@dataclass(frozen=True)
class ReferenceMethod(Method):
    """A bench-only method: not an adaspec engine (no `build`), run by `adaspec bench`."""

    other_weights: bool = False  # runs other weights than the target's (compared, not checked)


def other_weights(spec: MethodSpec) -> bool:
    """Runs other weights than the target's (llama.cpp's GGUF), so compared, not checked."""
    return isinstance(spec.method, ReferenceMethod) and spec.method.other_weights


REFERENCE_METHODS: Registry[Method] = Registry("reference method")
for _method in (
    ReferenceMethod(
        "hf", "[bench only] Hugging Face generate on the same target weights and device: plain "
        "decoding, a static KV cache", HfParams, None),
    ReferenceMethod(
        "hf-lookup", "[bench only] Hugging Face generate with prompt lookup "
        "(prompt_lookup_num_tokens=k) on the same target", HfLookupParams, None),
    ReferenceMethod(
        "hf-assisted", "[bench only] HF generate(assistant_model=draft), its default schedule",
        HfParams, None, needs_draft=_draft),
    ReferenceMethod(
        "hf-assisted-constant", "[bench only] Hugging Face assisted generation, constant k "
        "tokens", ConstantParams, None, needs_draft=_draft),
    ReferenceMethod(
        "llamacpp", "[bench only] greedy decoding of the target's GGUF by llama-cpp-python "
        "(other weights: compared for quality, not exactness; extra adaspec[llamacpp])",
        NoParams, None, other_weights=True),
    ReferenceMethod(
        "llamacpp-lookup", "[bench only] llama-cpp-python's prompt-lookup decoding "
        "(LlamaPromptLookupDecoding as Llama(draft_model=...), its own generate loop) on "
        "the target's GGUF, greedy (other weights, like llamacpp)", LookupParams, None,
        other_weights=True),
    ReferenceMethod(
        "llamacpp-draft", "[bench only] llama-cpp-python's speculative loop with the draft's "
        "GGUF as its draft model (greedy, k tokens per step) on the target's GGUF (other "
        "weights, like llamacpp)", GgufDraftParams, None, other_weights=True),
    ReferenceMethod(
        "llama-server", "[bench only] llama.cpp's own llama-server (a native build of the "
        "llama.cpp llama-cpp-python vendors, built on first use) driven over HTTP with the "
        "same prompt ids, greedy, streamed; spec picks its speculation (other weights, like "
        "llamacpp)", ServerParams, None, positional="spec", other_weights=True),
):
    REFERENCE_METHODS.register(_method.name, _method)


def parse_bench_method(text: str) -> MethodSpec:
    """A method the bench can run: any adaspec method, or a reference method."""
    return parse_method(text, extra=REFERENCE_METHODS)
