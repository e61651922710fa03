"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Requests accept the OpenAI fields plus adaspec's own: `top_k`, `method` (a method
string, as on the command line), `domain` (which online-distilled draft serves it),
`token_sources` (stream each token's text and how it was produced; the playground uses it),
`cache_prompt` (llama-server's: false prefills the whole prompt, reusing nothing kept),
and vLLM's names for a constraint beside `response_format`: `guided_json` (a JSON schema),
`guided_regex` and `guided_grammar` (a Lark grammar, as llguidance reads it). An OpenAI
field adaspec cannot honour (`echo`, `best_of`, ...) is refused with a message naming
it; a misspelt field is refused too, rather than silently ignored.
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from adaspec.core.grammar import Grammar
from adaspec.core.sampling import SEED_MAX, TOP_LOGPROBS_MAX
from adaspec.serve.tools import Tools

StrictInt = Annotated[int, Field(strict=True)]
N_MAX = 8  # answers one request may ask for (`n`)
StrictBool = Annotated[bool, Field(strict=True)]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, refusal, ...: not used
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: the call it answers

    def turn(self) -> dict[str, Any]:
        """The message as the chat template reads it (`developer` is OpenAI's newer name of
        the system role; a call's arguments as an object, as templates print them)."""
        turn: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                "content": self.text()}
        if self.tool_calls:
            calls = []
            for i, call in enumerate(self.tool_calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ValueError(f"tool_calls[{i}] needs function.name")
                args = fn.get("arguments") or {}
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        raise ValueError(f"tool_calls[{i}].function.arguments is not JSON: "
                                         f"{args[:80]!r}") from None
                calls.append({"type": "function", "id": call.get("id"),
                              "function": {"name": fn["name"], "arguments": args}})
            turn["tool_calls"] = calls
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        return turn

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"message content of type {part.type!r} is not supported: "
                                 "this server reads text only")
        return "".join(part.text or "" for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """The fields chat and text completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None  # the newer OpenAI name of max_tokens
    temperature: float = 1.0  # OpenAI's default; 0 is greedy
    top_p: float = 1.0
    top_k: StrictInt = 0  # extra: 0 disables it
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    method: str | None = None  # extra: a method string (default: the server's --method)
    domain: Annotated[str, Field(min_length=1, max_length=80)] | None = None  # extra: the
    # request's domain, whose draft serves it under --online-distill --osd-domains field
    token_sources: bool = False  # extra: stream chunks carry each token's text and source
    # extra (llama-server's name): false computes the whole prompt afresh, reusing no KV an
    # idle slot kept of an earlier request (a benchmark's cold request)
    cache_prompt: StrictBool = True
    # extras (vLLM's names): what the output must match; at most one, and not beside a
    # chat's response_format
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None

    # chat: logprobs true, with top_logprobs alternatives; completions: logprobs N
    logprobs: StrictBool | StrictInt | None = None
    top_logprobs: StrictInt | None = None
    # penalties and bias (applied to the target's rows: exact under speculation), then
    # accounting hints that change nothing here
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"must be an integer >= 1, got {v}")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not v >= 0 or v == float("inf"):
            raise ValueError(f"must be a finite number >= 0 (0 is greedy), got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError(f"must be in (0, 1], got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _non_negative(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(f"must be an integer >= 0, got {v}")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= SEED_MAX:
            raise ValueError(f"must be an integer in [0, 2**64 - 1], got {v}")
        return v

    @field_validator("n")
    @classmethod
    def _choices(cls, v: int) -> int:
        if not 1 <= v <= N_MAX:
            raise ValueError(f"n must be in [1, {N_MAX}] (answers per request), got {v}")
        return v


    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(stops)}")
        return v

    def bias(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs; ValueError naming a bad key."""
        out = []
        for key, value in (self.logit_bias or {}).items():
            try:
                out.append((int(key), float(value)))
            except ValueError:
                raise ValueError(f"logit_bias keys are token ids, got {key!r}") from None
        return tuple(out)

    def logprob_count(self, chat: bool) -> int | None:
        """How many alternatives per emitted token the request asks for (0: only the
        token's own log-probability), or None when it asks for no log-probabilities.
        Chat: `logprobs: true` and `top_logprobs: N`; completions: `logprobs: N`."""
        if chat:
            if self.logprobs is not None and not isinstance(self.logprobs, bool):
                raise ValueError("logprobs of a chat completion is true or false; "
                                 "top_logprobs says how many alternatives")
            if self.top_logprobs is not None and not self.logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
            n = (self.top_logprobs or 0) if self.logprobs else None
        else:
            if self.top_logprobs is not None:
                raise ValueError("top_logprobs is a chat completion field; a completion asks "
                                 "with logprobs: N")
            if isinstance(self.logprobs, bool):
                raise ValueError("logprobs of a completion is a number of alternatives, 0 to "
                                 f"{TOP_LOGPROBS_MAX}")
            n = self.logprobs
        if n is not None and not 0 <= n <= TOP_LOGPROBS_MAX:
            raise ValueError(f"top logprobs must be in [0, {TOP_LOGPROBS_MAX}], got {n}")
        return n

    def grammar(self) -> tuple[Grammar | None, str | None]:
        """The constraint the request asks for and the field that asked (None, None: none);
        InputError naming what is wrong with it."""
        from adaspec.errors import InputError

        asked = {name: value for name, value in self._constraints().items()
                 if value is not None}
        if len(asked) > 1:
            raise InputError(f"give one constraint, not {' and '.join(asked)}")
        if not asked:
            return None, None
        name, value = next(iter(asked.items()))
        if isinstance(value, Grammar):  # already built (tool_choice's)
            return value, name
        if name == "guided_regex":
            return Grammar("regex", value), name
        if name == "guided_grammar":
            return Grammar("lark", value), name
        if name == "guided_json":
            return Grammar.json_schema(value), name
        return _response_format(value), name

    def _constraints(self) -> dict[str, Any]:
        return {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                "guided_grammar": self.guided_grammar}

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    prediction: Any = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("give at least one message")
        return v

    @model_validator(mode="after")
    def _no_functions(self) -> ChatCompletionRequest:
        if self.functions or self.function_call not in (None, "none"):
            raise ValueError("functions and function_call (OpenAI's older API) are not "
                             "supported; give tools and tool_choice")
        if self.modalities and list(self.modalities) != ["text"]:
            raise ValueError("only the text modality is supported")
        return self

    def _constraints(self) -> dict[str, Any]:
        text = not self.response_format or self.response_format.get("type", "text") == "text"
        tools = self.tool_spec()
        return {**super()._constraints(),
                "response_format": None if text else self.response_format,
                "tool_choice": tools.grammar() if tools is not None else None}

    @cached_property
    def _tools(self) -> Tools | None:
        return Tools.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def tool_spec(self) -> Tools | None:
        """The request's tools and tool_choice, checked once (None: none, or tool_choice
        none); InputError naming what is wrong."""
        return self._tools

    def chat_turns(self) -> list[dict[str, Any]]:
        """The messages as the chat template reads them."""
        return [m.turn() for m in self.messages]


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[StrictInt]
    echo: bool = False
    best_of: StrictInt | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[str] | list[int]) -> str | list[str] | list[int]:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt is empty")
            if isinstance(v[0], str) and len(v) != 1:
                raise ValueError(f"one prompt per request is supported, got {len(v)}")
        return v

    @model_validator(mode="after")
    def _completion_extras(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported by adaspec serve")
        if self.best_of not in (None, 1):
            raise ValueError("best_of > 1 is not supported by adaspec serve")
        if self.suffix:
            raise ValueError("suffix is not supported by adaspec serve")
        return self

    def prompt_input(self) -> str | list[int]:
        """A text, or token ids."""
        if isinstance(self.prompt, str):
            return self.prompt
        if isinstance(self.prompt[0], str):
            return self.prompt[0]
        return list(self.prompt)


# ------------------------------------------------------------------------- responses
class SpeculationStats(BaseModel):
    """How the request was decoded: `usage.speculation` in every response."""

    method: str
    target_calls: int  # target forward passes, the prompt's prefill included
    draft_calls: int  # draft model passes
    head_calls: int = 0  # draft head steps (a few % of a target pass each)
    drafted: int  # draft tokens sent to verification
    accepted: int  # draft tokens the target accepted
    acceptance_rate: float
    mean_accepted_tokens: float  # new tokens per target call (1.0 for plain decoding)
    tokens_per_s: float  # new tokens over the decoding wall time
    decode_tokens_per_s: float  # the same, the first token (prefill) left out
    queue_time: float  # seconds waiting for the model (in the queue)
    time_to_first_token: float  # seconds of the prompt's prefill (queue time excluded)
    draft_time: float
    verify_time: float
    other_time: float
    wall_time: float  # seconds of decoding (queue time excluded)
    route: str | None = None  # the method a router picked
    # drafted tokens by what drafted them (auto's sources: ngram, history, draft, head; the
    # head method's: head; S2D's exits); None where nothing was drafted
    drafted_by: dict[str, int] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the KV cache already held (a conversation's turns)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    speculation: SpeculationStats | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: str
    logprobs: dict[str, Any] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str
    logprobs: dict[str, Any] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "adaspec"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _response_format(value: dict[str, Any]) -> Grammar:
    """OpenAI's `response_format`: {"type": "json_object"}, or {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}} (a strict schema and a loose
    one are held to alike: the output always matches the schema)."""
    from adaspec.errors import InputError

    kind = value.get("type")
    if kind == "json_object":
        return Grammar.json_object()
    if kind != "json_schema":
        raise InputError(f"response_format type must be text, json_object or json_schema, "
                         f"got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise InputError('response_format json_schema needs {"name": ..., "schema": {...}}')
    return Grammar.json_schema(spec.get("schema") or {"type": "object"})
