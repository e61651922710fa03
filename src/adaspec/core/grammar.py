"""Constrained decoding: what a request's output must match, and the matcher that says which
tokens may come next.

A `Grammar` is what the user asked for (a JSON schema, any JSON object, a Lark grammar, a
regular expression), checked when the request arrives. The engine compiles it for the
request's tokenizer into a `Constraint` (llguidance's matcher, the library llama.cpp uses: its
mask costs 0.16-0.23 ms a token on the 2-vCPU Xeon and it compiles a schema in under a
millisecond, `experiments/results/grammar-mask-cost-xeon-amx/`). The constraint belongs to
the request (`RequestState.constraint`) and moves only with its accepted tokens.

Exactness under speculation (docs/structured.md): every row of the target's pass is masked
by the state after the drafted tokens before it, so the verifier accepts and draws only what
the grammar allows; the draft's own distribution is not masked, so a forbidden drafted token
is simply rejected (its target probability is 0) and the residual keeps sampling exact. A
deterministic draft (n-grams, history, any draft at temperature 0) is cut before its first
forbidden token instead: the target spends no row on it, with the same result.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from adaspec.errors import InputError

KINDS = ("json_object", "json_schema", "lark", "regex")
# the JSON the model writes: compact separators unless the schema says otherwise
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """kind: one of KINDS; source: the schema (JSON text), the Lark grammar or the regex."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InputError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        problem = _llg().LLMatcher.validate_grammar(self.llguidance())
        if problem:
            raise InputError(f"{self.describe()} is not usable: {_first_line(problem)}")

    @classmethod
    def json_schema(cls, schema: Any) -> Grammar:
        """A JSON schema (a dict, or its text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InputError(f"the JSON schema is not valid JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise InputError("a JSON schema must be a JSON object")
        return cls("json_schema", json.dumps(schema))  # keys in the schema's order

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (`response_format: {"type": "json_object"}`)."""
        return cls("json_object")

    def describe(self) -> str:
        return {"json_object": "the JSON object format", "json_schema": "the JSON schema",
                "lark": "the Lark grammar", "regex": "the regular expression"}[self.kind]

    def llguidance(self) -> str:
        """The grammar as llguidance reads it."""
        llg = _llg()
        if self.kind == "lark":
            return llg.LLMatcher.grammar_from_lark(self.source)
        if self.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(self.source)
        schema = json.loads(self.source) if self.kind == "json_schema" else {"type": "object"}
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise InputError(f"{self.describe()} is not usable: {_first_line(str(exc))}") \
                from None

    def compile(self, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> Constraint:
        """A fresh matcher for one request over `tokenizer` (a fast Hugging Face tokenizer)
        and a model of `vocab_size` logits; `eos_token_ids`: the end of the output, allowed
        once the grammar is complete."""
        return Constraint(self, _tokenizer(tokenizer, vocab_size, eos_token_ids), vocab_size,
                          eos_token_ids)


class Constraint:
    """One request's position in its grammar: which tokens may come next, advanced by the
    accepted ones."""

    def __init__(self, grammar: Grammar, lltok, vocab_size: int,
                 eos_token_ids: set[int]) -> None:
        llg = _llg()
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._matcher = llg.LLMatcher(lltok, grammar.llguidance(), log_level=0)
        if self._matcher.is_error():
            raise InputError(f"{grammar.describe()} is not usable: "
                             f"{_first_line(self._matcher.get_error())}")
        self._words = (vocab_size + 31) // 32
        self._bits = torch.arange(32, dtype=torch.int32)

    def mask(self) -> torch.Tensor:
        """bool [V]: the tokens allowed next."""
        words = torch.empty(self._words, dtype=torch.int32)
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), self._words * 4)
        return ((words[:, None] >> self._bits) & 1).bool().reshape(-1)[: self.vocab_size]

    def masks_along(self, tokens: list[int]) -> tuple[int, torch.Tensor]:
        """How many leading `tokens` the grammar allows (n), and the masks [n + 1, V] before
        each of them and after the n-th; the constraint is left where it was."""
        masks = [self.mask()]
        consumed = 0
        for token in tokens:
            if not masks[-1][token]:
                break
            if token in self.eos_token_ids:  # the output ends here: what follows is not read
                masks.append(torch.ones_like(masks[0]))
                break
            if not self._matcher.consume_token(token):
                break
            consumed += 1
            masks.append(self.mask())
        if consumed:
            self._matcher.rollback(consumed)
        return len(masks) - 1, torch.stack(masks)

    def accept(self, tokens: list[int]) -> None:
        """The output went on with `tokens` (each one allowed where it came; an end token
        ends it, and nothing after one is read)."""
        for i, token in enumerate(tokens):
            if token in self.eos_token_ids:
                tokens = tokens[:i]
                break
        if tokens and not self._matcher.consume_tokens(tokens):
            raise RuntimeError(f"the grammar refused accepted tokens {tokens}: "
                               f"{self._matcher.get_error()}")

    def forced(self) -> list[int]:
        """The tokens the grammar allows as the only continuation from here (none where it
        leaves a choice)."""
        return list(self._matcher.compute_ff_tokens())

    @property
    def done(self) -> bool:
        """The output is complete: nothing may follow but the end of the output."""
        return bool(self._matcher.is_stopped())


def apply_masks(logits: torch.Tensor, masks: torch.Tensor | None) -> torch.Tensor:
    """logits [n, V] shifted by masks [n, V] (or fewer rows: the rest stay): bool, -inf where
    False; or float, added (a grammar's mask as 0 / -inf, a bias, penalties)."""
    if masks is None:
        return logits
    rows = min(len(logits), len(masks))
    out = logits.clone()
    masks = masks[:rows].to(out.device)
    if masks.dtype == torch.bool:
        out[:rows].masked_fill_(~masks, float("-inf"))
    else:
        out[:rows] += masks.to(out.dtype)
    return out


def mask_shift(masks: torch.Tensor) -> torch.Tensor:
    """bool masks [n, V] as an additive shift: 0 where allowed, -inf where not."""
    return torch.zeros(masks.shape).masked_fill_(~masks, float("-inf"))


_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()


def _tokenizer(tokenizer, vocab_size: int, eos_token_ids: set[int]):
    """llguidance's view of a Hugging Face tokenizer (about a second to build: once per
    tokenizer, vocabulary and end tokens)."""
    if tokenizer is None or not hasattr(tokenizer, "backend_tokenizer"):
        raise InputError("constrained output needs the model's (fast) tokenizer; this engine "
                         "has none that llguidance can read")
    key = (vocab_size, tuple(sorted(eos_token_ids)))
    known = _TOKENIZERS.setdefault(tokenizer, {})
    if key not in known:
        from llguidance.hf import from_tokenizer

        known[key] = from_tokenizer(tokenizer, n_vocab=vocab_size,
                                    eos_token=sorted(eos_token_ids) or None)
    return known[key]


def _llg():
    try:
        import llguidance
    except ImportError:
        raise InputError("constrained output (response_format, guided_grammar) needs "
                         "llguidance: pip install llguidance") from None
    return llguidance


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or ["unknown error"])[0][:300]
