"""The one parser for method strings, shared by the CLI, the bench and the library.

Grammar: ``NAME[:key=value[,key=value...]][@QUANT[/DRAFT_QUANT]]``, e.g. ``ar``, ``ngram:k=8``,
``draft:k=4``, ``draft:ctrl=heuristic,k=4``, ``draft:k=6,verify=speculative``,
``draft:tree=4x2x2x1,verify=mcss-wor`` (a token tree, multi-candidate verification),
``draft:k=4@int8/int4`` (int8 target, int4 draft weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from adaspec.backends.ikllama import IK
from adaspec.backends.llamacpp import GGUF
from adaspec.control.base import LengthController
from adaspec.control.confidence import HF_DEFAULT_THRESHOLD, ConfidenceLength
from adaspec.control.heuristic import HeuristicLength
from adaspec.control.oracle import OracleLength
from adaspec.control.static import StaticLength
from adaspec.engine.token_tree import DEFAULT_MAX_NODES, AutoBranching, parse_branching
from adaspec.errors import InputError
from adaspec.store.quant import QUANT_MODES

if TYPE_CHECKING:
    from adaspec.cost.profile import CostProfile

DEFAULT_METHOD = "auto"  # what `adaspec generate` and `load_engine` run

# name -> {parameter: (type, default, help)}
_COMMON = {
    "k": (int, 4, "tokens to draft per step (initial k for ctrl=heuristic)"),
    "ctrl": (
        str,
        "static",
        "length controller: static | heuristic (draft: also confidence | disco | oracle)",
    ),
    "k_max": (int, 16, "upper bound on k for ctrl=heuristic and ctrl=oracle"),
    "verify": (
        str,
        "auto",
        "verifier: auto (greedy at T=0, speculative above; mcss-wor above for trees) | "
        "greedy | speculative | mcss | mcss-wor | mcns (the last three verify trees)",
    ),
}
# Dynamic lengths that read the draft's distribution (ctrl=confidence, ctrl=disco).
_DYNAMIC = {
    "threshold": (
        float,
        -1.0,
        "ctrl=confidence: stop below this top draft probability (default "
        f"{HF_DEFAULT_THRESHOLD}, as Hugging Face; k bounds the draft); ctrl=disco: tau, "
        "stop below this acceptance probability (default: the artifact's tuned tau)",
    ),
    "disco": (str, "", "ctrl=disco: the artifact file from `adaspec disco tune`"),
    "sl_max": (
        int,
        0,
        "ctrl=disco: most tokens per draft (0: the artifact's tuned SL_max, for stop=cost the "
        "cap tuned for it, else 8)",
    ),
    "stop": (
        str,
        "tau",
        "ctrl=disco: tau (stop below the threshold, the paper's rule) | cost (draft another "
        "token while it raises the step's expected tokens per ms under the cost profile)",
    ),
    "guess": (
        str,
        "",
        "ctrl=disco,stop=cost: the next token's acceptance, unknown before it is drafted: last "
        "(the last probability) | mean (the request's running mean); default: the artifact's "
        "tuned one, else last",
    ),
}
METHODS: dict[str, dict[str, tuple[type, object, str]]] = {
    "ar": {},
    "draft": {
        **_COMMON,
        "tree": (
            str,
            "",
            "token tree, candidates per level, e.g. 4x2x2x1, or auto (each step the chain or "
            "tree with the most expected tokens per ms under the cost profile, from the "
            "request's acceptance per candidate rank) (unset: a chain of k)",
        ),
        "max_nodes": (int, DEFAULT_MAX_NODES, "limit on the drafted nodes of a tree"),
        **_DYNAMIC,
        "profile": (
            str,
            "",
            "cost profile of stop=cost and tree=auto: a JSON file, 'flat' or 'linear:...'; "
            "default: this machine's, measured on first use and cached",
        ),
        "vocab": (
            int,
            0,
            "draft head keeps only the N most frequent target tokens (0: full head; the set "
            "comes from `adaspec models restrict-vocab --top N`)",
        ),
    },
    "ngram": {
        **_COMMON,
        "k": (int, 8, "tokens to propose per step"),
        "n_max": (int, 3, "longest n-gram to match"),
        "n_min": (int, 1, "shortest n-gram to match"),
    },
    "auto": {
        "use": (
            str,
            "ngram+draft",
            "what a step may propose besides nothing: ngram+draft | ngram | draft",
        ),
        "k_max": (int, 16, "most tokens one step may propose"),
        "n_max": (int, 4, "longest n-gram to match"),
        "n_min": (int, 1, "shortest n-gram to match"),
        "profile": (
            str,
            "",
            "cost profile: a JSON file, or 'flat' (simulated GPU-like costs); default: this "
            "machine's, measured on first use and cached",
        ),
        "disco": (
            str,
            "",
            "a DISCO artifact (adaspec disco tune): its classifier estimates draft tokens' "
            "acceptance (default: running per-confidence-bucket rates)",
        ),
        "verify": _COMMON["verify"],
    },
    "router": {
        "artifact": (str, "", "trained router (adaspec router train); router:PATH is short"),
        "mode": (str, "greedy", "greedy (the policy's argmax) | dynamic (sample the policy)"),
        "seed": (int, 0, "seed of the dynamic policy (a request's own seed wins)"),
    },
}
DESCRIPTIONS = {
    "ar": "plain target decoding through the same loop (the baseline)",
    "draft": "the draft model proposes tokens autoregressively",
    "ngram": "prompt lookup: propose what followed the last match of the context's final n-gram",
    "router": "a trained policy picks one of its arms (methods) per request from the prompt",
    "auto": "cost-aware: each step proposes nothing, an n-gram or a draft-model continuation, "
    "whichever gives the most expected tokens per second under this machine's cost profile",
}
# Reference methods: Hugging Face assisted generation on the same loaded models, and llama.cpp
# (llama-cpp-python) plain and speculative decoding of the target's GGUF. They are not adaspec
# engines, so only `adaspec bench` runs them (parse_method(..., reference=True)).
REFERENCE_METHODS: dict[str, dict[str, tuple[type, object, str]]] = {
    "hf-assisted": {},
    "hf-assisted-constant": {"k": (int, 5, "assistant tokens per step (constant schedule)")},
    "llamacpp": {},
    "llamacpp-lookup": {
        "k": (int, 4, "tokens to propose per step (LlamaPromptLookupDecoding's num_pred_tokens)"),
        "n_max": (
            int,
            2,
            "longest n-gram to match (its max_ngram_size; 2 is llama-cpp-python's default)",
        ),
    },
    "llamacpp-draft": {"k": (int, 4, "tokens the draft GGUF proposes per step")},
}
REFERENCE_DESCRIPTIONS = {
    "hf-assisted": "[bench only] HF generate(assistant_model=draft), its default schedule",
    "hf-assisted-constant": "[bench only] Hugging Face assisted generation, constant k tokens",
    "llamacpp": "[bench only] greedy decoding of the target's GGUF by llama-cpp-python "
    "(other weights: compared for quality, not exactness; extra adaspec[llamacpp])",
    "llamacpp-lookup": "[bench only] llama-cpp-python's prompt-lookup decoding "
    "(LlamaPromptLookupDecoding as Llama(draft_model=...), its own generate loop) on the "
    "target's GGUF, greedy (other weights, like llamacpp)",
    "llamacpp-draft": "[bench only] llama-cpp-python's speculative loop with the draft's GGUF "
    "as its draft model (greedy, k tokens per step) on the target's GGUF (other weights, "
    "like llamacpp)",
}
# Reference methods that run other weights than the loaded torch target (llama.cpp reads the
# quantized GGUF; llamacpp-draft the draft's GGUF too, not the loaded torch draft): their
# greedy output is compared with `ar` as a quality figure, not checked.
OTHER_WEIGHTS = ("llamacpp", "llamacpp-lookup", "llamacpp-draft")
# What may follow a method's `@`: torch weight quantizations, or the GGUF run by llama.cpp
# (`gguf`) or by ik_llama.cpp (`ik`).
WEIGHT_VARIANTS = (*QUANT_MODES, GGUF, IK)
CONTROLLERS = ("static", "heuristic", "confidence", "disco", "oracle")
DRAFT_ONLY_CONTROLLERS = ("confidence", "disco", "oracle")  # read draft-model distributions
VERIFIERS = ("auto", "greedy", "speculative", "mcss", "mcss-wor", "mcns")
TREE_ONLY_VERIFIERS = ("mcss", "mcss-wor", "mcns")


@dataclass(frozen=True)
class MethodSpec:
    name: str
    params: dict[str, object] = field(default_factory=dict)
    text: str = ""
    # `@int8/int4` after the method: weight quantization of target / draft for this method
    # (None: whatever the run loaded), so the bench can put quantizations side by side.
    quant: str | None = None
    draft_quant: str | None = None

    def __getitem__(self, key: str) -> object:
        return self.params[key]

    @property
    def needs_draft_model(self) -> bool:
        if self.name == "router":  # when one of its arms does
            from adaspec.route.artifact import load_artifact

            arms = load_artifact(str(self.params["artifact"])).arms.values()
            return any(parse_method(m).needs_draft_model for m in arms)
        if self.name == "auto":
            return "draft" in str(self.params["use"]).split("+")
        return self.name == "draft" or (self.is_reference and not self.other_weights)

    @property
    def tree(self) -> tuple[int, ...] | None:
        """Branching factors per level when the method drafts a token tree."""
        text = self.params.get("tree")
        if not text:
            return None
        return parse_branching(str(text), int(self.params["max_nodes"]))  # type: ignore[call-overload]

    @property
    def is_reference(self) -> bool:
        """A reference method: run by the bench, never built into an Engine."""
        return self.name in REFERENCE_METHODS

    @property
    def other_weights(self) -> bool:
        """Runs other weights than the torch target (llama.cpp's GGUF), so not exact."""
        return self.name in OTHER_WEIGHTS


def split_method_list(text: str) -> list[str]:
    """Split "ar,ngram,draft:k=4,verify=mcss" into method strings: a comma starts a new
    method only when what follows is not a `key=value` parameter of the previous one."""
    methods: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if methods and "=" in part and ":" not in part.split("=", 1)[0]:
            methods[-1] += "," + part
        else:
            methods.append(part)
    return methods


def _parse_variant(text: str, variant: str) -> tuple[str | None, str | None]:
    """`int8` or `int8/int4` (target / draft weights) after a method's `@`: a torch
    quantization, or `gguf` (the model's GGUF run by llama.cpp)."""
    quant, _, draft_quant = (v.strip() for v in variant.partition("/"))
    for value in (quant, draft_quant):
        if value and value not in WEIGHT_VARIANTS:
            raise InputError(
                f"method {text!r}: unknown weights {value!r} after '@'; use "
                f"{'|'.join(WEIGHT_VARIANTS)}, e.g. draft:k=4@int8/int4 (target/draft)"
            )
    if not quant:
        raise InputError(f"method {text!r}: give a quantization after '@', e.g. ar@int8")
    return quant, draft_quant or None


def parse_method(text: str, reference: bool = False) -> MethodSpec:
    """Parse and validate a method string; every mistake is an InputError naming the fix.

    reference=True also accepts the bench-only reference methods (REFERENCE_METHODS).
    """
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"empty method name; known methods: {', '.join(METHODS)}")
    text = text.strip()
    body, at, variant = text.partition("@")
    quant, draft_quant = _parse_variant(text, variant) if at else (None, None)
    name, _, rest = body.partition(":")
    name = name.strip()
    if name in REFERENCE_METHODS and not reference:
        raise InputError(
            f"method {name!r} is a reference method that only "
            f"`adaspec bench` runs; here use one of: {', '.join(METHODS)}"
        )
    if name not in METHODS and name not in REFERENCE_METHODS:
        raise InputError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    schema = METHODS[name] if name in METHODS else REFERENCE_METHODS[name]
    params: dict[str, object] = {key: default for key, (_, default, _) in schema.items()}
    if name == "router" and rest.strip() and "=" not in rest.split(",", 1)[0]:
        path, _, rest = rest.partition(",")  # router:PATH[,mode=dynamic]
        params["artifact"] = path.strip()
    if rest.strip():
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq:
                raise InputError(f"method {text!r}: expected key=value, got {item!r}")
            if key not in schema:
                known = ", ".join(schema) or "none"
                raise InputError(f"method {name!r} has no parameter {key!r} (parameters: {known})")
            kind = schema[key][0]
            try:
                params[key] = kind(value.strip())
            except ValueError:
                raise InputError(
                    f"method {text!r}: {key} must be {kind.__name__}, got {value!r}"
                ) from None
    if "ctrl" in params and params["ctrl"] not in CONTROLLERS:
        raise InputError(f"unknown length controller {params['ctrl']!r}; use one of {CONTROLLERS}")
    if params.get("ctrl") in DRAFT_ONLY_CONTROLLERS and name != "draft":
        raise InputError(f"method {text!r}: ctrl={params['ctrl']} needs the draft model (draft:)")
    if "verify" in params and params["verify"] not in VERIFIERS:
        raise InputError(f"unknown verifier {params['verify']!r}; use one of {VERIFIERS}")
    if "k" in params and int(params["k"]) < 1:  # type: ignore[call-overload]
        raise InputError(f"method {text!r}: k must be >= 1")
    if int(params.get("vocab", 0)) < 0:  # type: ignore[call-overload]
        raise InputError(f"method {text!r}: vocab must be >= 0 (0 keeps the full head)")
    if name == "ngram" and not 1 <= int(params["n_min"]) <= int(params["n_max"]):  # type: ignore[call-overload]
        raise InputError(f"method {text!r}: need 1 <= n_min <= n_max")
    if name == "router":
        _check_router_params(text, params)
    if name == "auto":
        _check_auto_params(text, params)
    spec = MethodSpec(name, params, text, quant, draft_quant)
    if "verify" in params:
        _check_tree_params(spec)
    return spec


AUTO_SOURCES = ("ngram", "draft")


def _check_auto_params(text: str, params: dict[str, object]) -> None:
    use = str(params["use"]).split("+")
    if not use or any(u not in AUTO_SOURCES for u in use) or len(set(use)) != len(use):
        raise InputError(f"method {text!r}: use must be ngram+draft, ngram or draft")
    if int(params["k_max"]) < 1:  # type: ignore[call-overload]
        raise InputError(f"method {text!r}: k_max must be >= 1")
    if not 1 <= int(params["n_min"]) <= int(params["n_max"]):  # type: ignore[call-overload]
        raise InputError(f"method {text!r}: need 1 <= n_min <= n_max")


def _check_router_params(text: str, params: dict[str, object]) -> None:
    if not params["artifact"]:
        raise InputError(f"method {text!r}: give the router artifact, e.g. router:router.pt")
    if params["mode"] not in ("greedy", "dynamic"):
        raise InputError(f"method {text!r}: mode must be greedy or dynamic")


def _check_tree_params(spec: MethodSpec) -> None:
    tree = spec.tree if "tree" in spec.params else None  # parses: a bad config raises here
    verify = spec["verify"]
    if tree is None and verify in TREE_ONLY_VERIFIERS:
        raise InputError(
            f"method {spec.text!r}: verify={verify} walks a token tree; add tree=... "
            "(e.g. draft:tree=4x2x2x1) or use verify=speculative"
        )
    if tree is not None and verify == "speculative":
        raise InputError(
            f"method {spec.text!r}: verify=speculative checks chains; a tree needs "
            "verify=mcss, mcss-wor, mcns or greedy"
        )
    if tree is not None and spec["ctrl"] != "static":
        raise InputError(
            f"method {spec.text!r}: a token tree has a fixed shape; ctrl={spec['ctrl']} "
            "only works with chains"
        )


def build_controller(spec: MethodSpec, profile: CostProfile | None = None) -> LengthController:
    """The length controller of a method. `profile` prices DISCO's cost rule (stop=cost);
    build_engine resolves it (the method's profile=..., else this machine's)."""
    if spec.name in ("ar", "router"):  # a router uses the controller of the arm it picks
        return StaticLength(1)
    if spec.name == "auto":  # the drafter prices every length itself; this only bounds it
        return StaticLength(int(spec["k_max"]))  # type: ignore[call-overload]
    if spec.name == "draft":  # settings that would otherwise be ignored without a word
        if spec["ctrl"] != "disco" and (spec["stop"] != "tau" or spec["guess"]):
            raise InputError(f"method {spec.text!r}: stop and guess are ctrl=disco's settings")
        if spec["profile"] and spec["stop"] != "cost" and not isinstance(spec.tree, AutoBranching):
            raise InputError(f"method {spec.text!r}: profile prices stop=cost and tree=auto "
                             "only; the other settings do not read costs")
    tree = spec.tree if "tree" in spec.params else None
    if isinstance(tree, AutoBranching):
        return StaticLength(tree.max_depth)  # the drafter picks a shape at most this deep
    if tree is not None:
        return StaticLength(len(tree))  # the depth of the tree
    k = int(spec["k"])  # type: ignore[call-overload]
    if spec["ctrl"] == "heuristic":
        return HeuristicLength(k=k, k_max=max(k, int(spec["k_max"])))  # type: ignore[call-overload]
    if spec["ctrl"] in DRAFT_ONLY_CONTROLLERS:
        return _dynamic_controller(spec, k, profile)
    return StaticLength(k)


def _dynamic_controller(
    spec: MethodSpec, k: int, profile: CostProfile | None = None
) -> LengthController:
    threshold = float(spec["threshold"])  # type: ignore[arg-type]
    if spec["ctrl"] == "confidence":
        return ConfidenceLength(threshold if threshold >= 0 else HF_DEFAULT_THRESHOLD, k)
    if spec["ctrl"] == "oracle":
        return OracleLength(k_max=int(spec["k_max"]))  # type: ignore[call-overload]
    from adaspec.control.disco import DiscoLength  # loads torch.nn only when used

    stop = str(spec["stop"])
    if stop == "cost" and threshold >= 0:
        raise InputError(f"method {spec.text!r}: threshold is tau, the stop=tau rule's; "
                         "stop=cost has none")
    sl_max = int(spec["sl_max"])  # type: ignore[call-overload]
    return DiscoLength.from_file(
        str(spec["disco"]), tau=threshold if threshold >= 0 else None, sl_max=sl_max or None,
        stop=stop, profile=profile if stop == "cost" else None,
        guess=str(spec["guess"]) or None,
    )


def describe_methods() -> str:
    lines = []
    for name, schema in METHODS.items():
        lines.append(f"{name}: {DESCRIPTIONS[name]}")
        for key, (kind, default, help_) in schema.items():
            lines.append(f"    {key}={default!s:<8} ({kind.__name__}) {help_}")
    for name, schema in REFERENCE_METHODS.items():
        lines.append(f"{name}: {REFERENCE_DESCRIPTIONS[name]}")
        for key, (kind, default, help_) in schema.items():
            lines.append(f"    {key}={default!s:<8} ({kind.__name__}) {help_}")
    return "\n".join(lines)
