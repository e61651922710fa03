"""Response bodies and server-sent events in the OpenAI shapes, from the engine's results."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from adaspec.core.sampling import TokenLogprob
from adaspec.engine.steps import GenerationResult
from adaspec.serve.schema import (
    ChatChoice,
    ChatCompletion,
    ChatResponseMessage,
    Completion,
    CompletionChoice,
    PromptTokensDetails,
    SpeculationStats,
    Usage,
)
from adaspec.serve.tools import parse as parse_tool_calls

# the engine's reasons -> OpenAI's: an end-of-sequence token and a stop string both "stop"
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}

DONE_EVENT = b"data: [DONE]\n\n"


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def now() -> int:
    return int(time.time())


def usage(result: GenerationResult, method: str, queue_time: float) -> Usage:
    s = result.stats
    return Usage(
        prompt_tokens=s.prompt_tokens,
        completion_tokens=s.new_tokens,
        total_tokens=s.prompt_tokens + s.new_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=s.cached_tokens),
        speculation=SpeculationStats(
            method=method,
            target_calls=s.target_calls,
            draft_calls=s.draft_calls,
            head_calls=s.head_calls,
            drafted=s.drafted,
            accepted=s.accepted,
            acceptance_rate=round(s.acceptance_rate, 4),
            mean_accepted_tokens=round(s.mean_accepted_tokens, 4),
            tokens_per_s=round(s.tokens_per_s, 3),
            decode_tokens_per_s=round(s.decode_tokens_per_s, 3),
            queue_time=round(queue_time, 4),
            time_to_first_token=round(s.prefill_time, 4),
            draft_time=round(s.draft_time, 4),
            verify_time=round(s.verify_time, 4),
            other_time=round(s.other_time, 4),
            wall_time=round(s.wall_time, 4),
            drafted_by=dict(s.drafted_by) or None,
            route=s.route,
        ),
    )


TokenText = Callable[[int], str]  # a token id's text (the instance's tokenizer)


def logprobs(chat: bool, entries: Sequence[TokenLogprob], text: TokenText,
             offset: int = 0) -> dict[str, Any]:
    """OpenAI's logprobs object. Chat: `content`, one entry per token with its bytes and
    `top_logprobs`; completions: the parallel lists `tokens`, `token_logprobs`,
    `top_logprobs` and `text_offset` (character offsets from `offset`)."""
    if chat:
        def item(token: int, logprob: float) -> dict[str, Any]:
            s = text(token)
            return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

        return {"content": [{**item(e.token, e.logprob),
                             "top_logprobs": [item(t, v) for t, v in e.top]}
                            for e in entries],
                "refusal": None}
    tokens = [text(e.token) for e in entries]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t): v for t, v in e.top} for e in entries],
            "text_offset": offsets}


def chat_completion(rid: str, created: int, model: str, result: GenerationResult,
                    use: Usage, text: TokenText | None = None,
                    tools: bool = False) -> dict[str, Any]:
    """`tools`: the request offered tools: the answer's tool-call blocks become
    `message.tool_calls` (`serve/tools.py`), with finish_reason "tool_calls"."""
    lp = (logprobs(True, result.logprobs, text)
          if result.logprobs is not None and text is not None else None)
    content: str | None = result.text
    calls: list[dict[str, Any]] = []
    if tools:
        content, calls = parse_tool_calls(result.text)
    finish = "tool_calls" if calls else FINISH[result.finish_reason]
    return ChatCompletion(
        id=rid, created=created, model=model, usage=use,
        choices=[ChatChoice(message=ChatResponseMessage(content=content,
                                                        tool_calls=calls or None),
                            finish_reason=finish, logprobs=lp)],
    ).model_dump()


def completion(rid: str, created: int, model: str, result: GenerationResult,
               use: Usage, text: TokenText | None = None) -> dict[str, Any]:
    lp = (logprobs(False, result.logprobs, text)
          if result.logprobs is not None and text is not None else None)
    return Completion(
        id=rid, created=created, model=model, usage=use,
        choices=[CompletionChoice(text=result.text,
                                  finish_reason=FINISH[result.finish_reason], logprobs=lp)],
    ).model_dump()


def merge_choices(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """One response of several answers to one prompt (`n` > 1): the first's, with every
    answer's choice (`index` i) and the completion tokens summed (the prompt counted once;
    `usage.speculation` is the first answer's)."""
    out = dict(bodies[0])
    out["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
    use = dict(out["usage"])
    use["completion_tokens"] = sum(b["usage"]["completion_tokens"] for b in bodies)
    use["total_tokens"] = use["prompt_tokens"] + use["completion_tokens"]
    out["usage"] = use
    return out


def chunk(chat: bool, rid: str, created: int, model: str, *, text: str | None = None,
          role: bool = False, finish_reason: str | None = None, use: Usage | None = None,
          tokens: list[list[str]] | None = None, no_choice: bool = False,
          logprobs: dict[str, Any] | None = None,
          tool_calls: list[dict[str, Any]] | None = None, index: int = 0) -> dict[str, Any]:
    """One streamed chunk. `tokens` ([piece, source] per token) is adaspec's extra for the
    playground; `no_choice` is the usage-only chunk of stream_options.include_usage."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
    }
    if no_choice:
        body["choices"] = []
    elif chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls  # each with its "index"
        body["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs,
                            "finish_reason": finish_reason}]
    else:
        body["choices"] = [{"index": index, "text": text or "", "logprobs": logprobs,
                            "finish_reason": finish_reason}]
    if use is not None:
        body["usage"] = use.model_dump()
    if tokens is not None:
        body["adaspec"] = {"tokens": tokens}
    return body


def sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
