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
    OpenAI's shape; a block that is not a JSON call with a name stays in the text."""
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
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": name, "arguments": args if isinstance(args, str)
                                   else json.dumps(args, ensure_ascii=False)}})
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else (text or None), calls


class ToolStream:
    """Streamed text of an answer that may call tools: text goes out as it comes until a
    tool-call block may be starting; from there it is held, and `finish` parses it."""

    def __init__(self) -> None:
        self.held = ""
        self.calling = False

    def push(self, text: str) -> str:
        """The part of `text` that can go out now as content."""
        if self.calling:
            self.held += text
            return ""
        pending = self.held + text
        start = pending.find(OPEN)
        if start >= 0:
            self.calling, self.held = True, pending[start:]
            out = pending[:start]
        else:  # keep back what could be the start of OPEN
            keep = next((k for k in range(min(len(OPEN) - 1, len(pending)), 0, -1)
                         if OPEN.startswith(pending[-k:])), 0)
            out, self.held = pending[: len(pending) - keep], pending[len(pending) - keep:]
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left to send as content, and the calls."""
        if not self.calling:
            rest, self.held = self.held, ""
            return rest, []
        content, calls = parse(self.held)
        if not calls:
            return self.held, []
        return content or "", calls
