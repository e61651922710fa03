"""The router's arms: named method strings, from a list or a JSON config.

Any method `methods.spec` parses can be an arm, so drafters added later (sorted early
exits, distilled drafts) join the router without changes here. An arm's name defaults to its
method string; a config file can name them: {"arms": {"fast": "draft:k=2", "plain": "ar"}}.
"""

from __future__ import annotations

import json
from pathlib import Path

from adaspec.errors import InputError
from adaspec.methods.spec import MethodSpec, parse_method, split_method_list

# genuinely different drafts (issue 66): none, the request's n-grams and earlier requests,
# the draft head over the target's features, the 0.5B draft model
DEFAULT_ARMS = ("ar", "auto:use=ngram+history", "head:k=1", "draft:k=4")


def check_arms(arms: dict[str, str]) -> dict[str, MethodSpec]:
    """Parse every arm's method; a router needs two arms or more and no nested router."""
    if len(arms) < 2:
        raise InputError(f"a router needs at least two arms to choose from, got {list(arms)}")
    specs = {}
    for name, method in arms.items():
        if not isinstance(name, str) or not name.strip():
            raise InputError("arm names must be non-empty strings")
        spec = parse_method(method)
        if spec.name == "router":
            raise InputError(f"arm {name!r}: a router cannot be an arm of another router")
        specs[name] = spec
    return specs


def parse_arms(text: str | None) -> dict[str, str]:
    """`ar,ngram,draft:k=4` (names = method strings) or the path of a JSON config."""
    if text is None or not text.strip():
        arms = {m: m for m in DEFAULT_ARMS}
    elif text.strip().endswith(".json"):
        arms = _read_config(Path(text.strip()))
    else:
        methods = split_method_list(text)
        if len(set(methods)) != len(methods):
            raise InputError(f"arms repeat a method: {methods}")
        arms = {m: m for m in methods}
    check_arms(arms)
    return arms


def _read_config(path: Path) -> dict[str, str]:
    if not path.is_file():
        raise InputError(f"arms config not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"arms config {path} is not valid JSON ({exc})") from None
    arms = data.get("arms") if isinstance(data, dict) else None
    if isinstance(arms, list):
        arms = {str(m): str(m) for m in arms}
    if not isinstance(arms, dict) or not all(isinstance(v, str) for v in arms.values()):
        raise InputError(
            f"arms config {path}: expected {{\"arms\": {{\"name\": \"method\", ...}}}} "
            "or {\"arms\": [\"method\", ...]}"
        )
    return dict(arms)


def arm_parameters(spec: MethodSpec, target_params: int, draft_params: int | None,
                   target_name: str = "") -> int:
    """Parameters run to draft one token: the paper's cost input. Plain decoding "drafts"
    with the target itself, n-gram lookup with no model at all, the draft head with its own
    layer and kept output rows (`target_name`: whose shipped head)."""
    method = spec.method
    drafts_with = method.drafts_with if method is not None else ""
    if method is not None and method.own_parameters is not None:
        return method.own_parameters(spec.params, target_name, draft_params)
    if drafts_with == "target":
        return target_params
    if drafts_with == "nothing":
        return 0
    if spec.needs_draft_model():
        if draft_params is None:
            raise InputError(f"arm {spec.text!r} needs a draft model")
        return draft_params
    raise InputError(f"no parameter count known for arm {spec.text!r}")


def count_parameters(backend) -> int | None:
    """Parameter count of a backend's model: a torch model's, or what a GGUF runtime reports
    (`n_params`); None for a backend that tells neither."""
    model = getattr(backend, "model", None)
    if model is None:
        n = getattr(backend, "n_params", None)
        return int(n) if n else None
    return int(sum(p.numel() for p in model.parameters()))
