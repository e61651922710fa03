"""Tool calls in OpenAI's shape over the model's own tool-call text.

The tools go into the prompt through the model's chat template (Qwen2.5's renders them in its
system turn and asks for `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
blocks, the Hermes format vLLM's `hermes` parser reads). The answer's blocks become
`message.tool_calls` with `finish_reason: "tool_calls"`; `tool_choice` `required` or a named
function constrains the answer to such blocks, each call's arguments held to its function's
JSON schema (a Lark grammar with llguidance's `%json`, `core/grammar.py`), so exact under
every method like any constraint.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from adaspec.core.grammar import Grammar
from adaspec.errors import InputError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
# the JSON the model writes in a call: Qwen's own layout (compact, a space after : and ,)
_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@dataclass(frozen=True)
class Tools:
    """A request's functions (name -> JSON schema of the arguments), in the order given, the
    chat template's view of them, and what `tool_choice` asks."""

    functions: tuple[tuple[str, str], ...]  # (name, parameters as JSON text)
    template: tuple[str, ...]  # each tool as the chat template reads it (JSON text)
    choice: str  # "auto" | "required" | "function"
    named: str | None = None  # the function `tool_choice` names
    parallel: bool = True

    @classmethod
    def of(cls, tools: list[Any] | None, tool_choice: Any,
           parallel: bool | None) -> Tools | None:
        """The request's tools, checked (None: no tools, or `tool_choice: "none"`);
        InputError naming what is wrong."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise InputError("tool_choice needs tools")
            return None
        functions: list[tuple[str, str]] = []
        template: list[str] = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                    or not isinstance(tool.get("function"), dict):
                raise InputError(f'tools[{i}] must be {{"type": "function", "function": '
                                 '{"name": ..., "parameters": {...}}}')
            fn = tool["function"]
            name = fn.get("name")
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
                raise InputError(f"tools[{i}].function.name must be 1-64 letters, digits, "
                                 f"_ . or -, got {name!r}")
            if name in dict(functions):
                raise InputError(f"two tools are named {name!r}")
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            if not isinstance(params, dict):
                raise InputError(f"tools[{i}].function.parameters must be a JSON schema "
                                 "object")
            Grammar.json_schema(params)  # a schema llguidance cannot use fails here
            functions.append((name, json.dumps(params)))
            template.append(json.dumps({"type": "function", "function": {
                "name": name, "description": fn.get("description") or "",
                "parameters": params}}))
        named = None
        if tool_choice in (None, "auto"):
            choice = "auto"
        elif tool_choice == "none":
            return None
        elif tool_choice == "required":
            choice = "required"
        elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
                and isinstance(tool_choice.get("function"), dict):
            choice, named = "function", tool_choice["function"].get("name")
            if named not in dict(functions):
                raise InputError(f"tool_choice names {named!r}, which is not among the tools "
                                 f"({', '.join(n for n, _ in functions)})")
        else:
            raise InputError('tool_choice must be "auto", "none", "required" or '
                             '{"type": "function", "function": {"name": ...}}')
        return cls(tuple(functions), tuple(template), choice, named,
                   True if parallel is None else bool(parallel))

    def for_template(self) -> list[dict[str, Any]]:
        return [json.loads(t) for t in self.template]

    def grammar(self) -> Grammar | None:
        """The constraint `tool_choice` asks for: one call of the named function, or at
        least one call of any (one only unless parallel calls are allowed); None for
        `auto` (the model may answer in text)."""
        if self.choice == "auto":
            return None
        names = ([self.named] if self.choice == "function" and self.named is not None
                 else [n for n, _ in self.functions])
        params = dict(self.functions)
        calls = [{"type": "object", "x-guidance": _LAYOUT,
                  "properties": {"name": {"const": n}, "arguments": json.loads(params[n])},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for n in names]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls, "x-guidance": _LAYOUT}
        many = self.parallel and self.choice == "required"
        more = ' ("\\n" call)*' if many else ""
        lark = (f"start: call{more}\n"
                f'call: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"\n')
        return Grammar("lark", lark)


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The answer's text outside tool-call blocks (None when empty) and its calls in
    OpenAI's shape; a block that is not a JSON call with a name stays in the text. A call's
    `arguments` is the model's own text of them where that is their JSON (what the stream
    sends piece by piece), else their JSON."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for m in _BLOCK.finditer(text):
        try:
            body = json.loads(m.group(1))
            name, args = body["name"], body.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError):
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append({"id": _call_id(), "type": "function",
                      "function": {"name": name, "arguments": _arguments(m.group(1), args)}})
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else (text or None), calls


# the start of a call's JSON up to its arguments: Qwen writes the name first
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _closed_arguments(body: str, start: int) -> str:
    """The arguments' text of a whole call body: from `start` to before the call's own
    closing brace."""
    rest = body[start:].rstrip()
    return rest[:-1].rstrip() if rest.endswith("}") else rest


def _arguments(body: str, args: Any) -> str:
    if isinstance(args, str):
        return args
    head = _HEAD.match(body)
    if head is not None:
        raw = _closed_arguments(body, head.end())
        try:
            if json.loads(raw) == args:
                return raw
        except ValueError:
            pass
    return json.dumps(args, ensure_ascii=False)


def _held_back(text: str, marker: str = CLOSE) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1)
                 if marker.startswith(text[-k:])), 0)


class ToolStream:
    """Streamed text of an answer that may call tools, as OpenAI streams it: content goes
    out as it comes until a tool-call block may be starting; a call goes out as soon as its
    name is read (a `tool_calls` delta with its index, id and name), then its arguments'
    text piece by piece, held back only where it could be the call's closing brace or
    `</tool_call>`. A block that turns out not to be a call goes out as content when it
    closes; whitespace between calls is not sent (`parse` strips it too)."""

    def __init__(self) -> None:
        self.buf = ""  # text not sent yet: a possible start of OPEN, or the open block's body
        self.calling = False  # inside a block
        self.calls = 0  # calls begun
        self.sent = -1  # the open call's argument characters sent (-1: its name not read)
        self.start = 0  # where the open call's arguments begin in `buf`
        self.gap = ""  # whitespace after a call, sent only if more content follows

    @property
    def called(self) -> bool:
        return self.calls > 0

    def push(self, text: str) -> list[dict[str, Any]]:
        """The deltas `text` lets go out now: `{"content": str}` or `{"tool_calls": [...]}`."""
        self.buf += text
        out: list[dict[str, Any]] = []
        while True:
            if not self.calling:
                at = self.buf.find(OPEN)
                if at < 0:  # keep back what could be the start of OPEN
                    keep = _held_back(self.buf, OPEN)
                    self._content(out, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                self._content(out, self.buf[:at])
                self.buf, self.calling, self.sent = self.buf[at + len(OPEN):], True, -1
            end = self.buf.find(CLOSE)
            body = self.buf if end < 0 else self.buf[:end]
            if self.sent < 0:
                head = _HEAD.match(body)
                if head is None:
                    if end < 0:
                        return out
                    self._content(out, OPEN + self.buf[:end + len(CLOSE)])  # not a call
                    self.buf, self.calling = self.buf[end + len(CLOSE):], False
                    continue
                out.append({"tool_calls": [{
                    "index": self.calls, "id": _call_id(), "type": "function",
                    "function": {"name": json.loads(head.group(1)), "arguments": ""}}]})
                self.calls, self.sent, self.start = self.calls + 1, 0, head.end()
            if end < 0:
                safe = body[:len(body) - _held_back(body)].rstrip()
                safe = safe[self.start:]
                safe = safe[:-1].rstrip() if safe.endswith("}") else safe
            else:  # the block closed: its arguments are whole
                safe = _closed_arguments(body, self.start)
            self._arguments(out, safe)
            if end < 0:
                return out
            self.buf, self.calling = self.buf[end + len(CLOSE):], False

    def finish(self) -> list[dict[str, Any]]:
        """The deltas left at the answer's end (a block cut short: its text, or the rest of
        its call's arguments)."""
        out: list[dict[str, Any]] = []
        if self.calling and self.sent >= 0:
            self._arguments(out, self.buf[self.start:])
        else:
            self._content(out, (OPEN if self.calling else "") + self.buf)
        self.buf, self.calling = "", False
        return out

    def _arguments(self, out: list[dict[str, Any]], safe: str) -> None:
        if len(safe) > self.sent:
            out.append({"tool_calls": [{"index": self.calls - 1,
                                        "function": {"arguments": safe[self.sent:]}}]})
            self.sent = len(safe)

    def _content(self, out: list[dict[str, Any]], text: str) -> None:
        if self.called:  # after a call, whitespace waits for content that is not
            self.gap += text
            if not self.gap.strip():
                return
            text, self.gap = self.gap, ""
        if not text:
            return
        if out and "content" in out[-1]:
            out[-1]["content"] += text
        else:
            out.append({"content": text})
