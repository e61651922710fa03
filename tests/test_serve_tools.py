"""Tool calls through `adaspec serve` on tiny models (their tokenizer given a Hermes-style chat
template, Qwen2.5's format): `tool_choice` naming a function or `required` constrains the
answer to calls whose arguments match the function's schema, parsed into
`message.tool_calls`, streamed as a `tool_calls` delta; an earlier call and the tool's answer
are accepted in the history; the `openai` client's tool loop runs; bad tools are 400s."""

from __future__ import annotations

import json

import jsonschema
import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from adaspec.serve.tools import Tools, ToolStream, parse  # noqa: E402

from .test_serve import adaspec_home, live_server, served_instance  # noqa: E402, F401

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}"
    "{{ t | tojson }}\n{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from .conftest import save_tiny_pair

    # the tools' JSON takes some 600 of the byte-level tokenizer's tokens
    instance = served_instance(*save_tiny_pair(tmp_path_factory.mktemp("models"),
                                               context=2048))
    instance.tokenizer.chat_template = TEMPLATE  # the engines read this tokenizer
    with live_server(instance) as url:
        yield url
    instance.close()


def chat(base: str, **body) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions",
                      json={"max_tokens": 200, "temperature": 0, **body}, timeout=60)


def check_calls(calls: list[dict]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        fn = call["function"]
        jsonschema.validate(json.loads(fn["arguments"]), PARAMS[fn["name"]])


def test_a_named_function_is_called_with_arguments_that_match_its_schema(base):
    for temperature in (0, 0.9):
        r = chat(base, messages=ASK, tools=TOOLS, temperature=temperature, seed=1,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        calls = choice["message"]["tool_calls"]
        check_calls(calls)
        assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_required_calls_one_tool_or_several_and_auto_may_answer_in_text(base):
    r = chat(base, messages=ASK, tools=TOOLS, tool_choice="required",
             parallel_tool_calls=False)
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    check_calls(calls)
    assert len(calls) == 1
    r = chat(base, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=400)
    check_calls(r.json()["choices"][0]["message"]["tool_calls"])
    r = chat(base, messages=ASK, tools=TOOLS)  # auto: the random model writes text
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    none = chat(base, messages=ASK, tools=TOOLS, tool_choice="none").json()["choices"][0]
    plain = chat(base, messages=ASK).json()["choices"][0]
    assert none["message"]["content"] == plain["message"]["content"]  # no tools rendered


def test_calls_stream_as_tool_calls_deltas(base):
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 200, "temperature": 0,
            "stream": True, "tool_choice": {"type": "function",
                                            "function": {"name": "get_time"}}}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert not "".join(d.get("content") or "" for d in deltas).strip()
    pieces = [c for d in deltas for c in d.get("tool_calls", [])]
    assert {c["index"] for c in pieces} == {0} and "id" in pieces[0]
    call = {"id": pieces[0]["id"], "type": "function", "function": {
        "name": pieces[0]["function"]["name"],
        "arguments": "".join(c["function"]["arguments"] for c in pieces)}}
    check_calls([call])
    whole = chat(base, **{k: v for k, v in body.items() if k != "stream"}).json()
    assert call["function"] == whole["choices"][0]["message"]["tool_calls"][0]["function"]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] \
        == "tool_calls"


def test_the_openai_clients_tool_loop(base):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    first = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    call = message.tool_calls[0]
    assert call.function.name == "get_weather"
    history = [*ASK, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    # streamed, the client's own accumulator assembles the same call from the deltas
    with client.chat.completions.stream(
            model="tiny", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0].message.tool_calls[0]
    assert streamed.function.name == call.function.name
    assert streamed.function.arguments == call.function.arguments
    final = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                           max_tokens=12, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    longer = final.usage.prompt_tokens
    shorter = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                             max_tokens=1).usage.prompt_tokens
    assert longer > shorter + 10  # the call and its answer are in the prompt


def test_bad_tools_are_400s_naming_them(base):
    def refused(**body) -> str:
        r = chat(base, **{"messages": ASK, **body})
        assert r.status_code == 400, r.text
        return r.json()["error"]["message"]

    assert "not among the tools" in refused(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "nope"}})
    assert "tool_choice needs tools" in refused(tool_choice="required")
    assert 'must be {"type": "function"' in refused(tools=[{"type": "web"}])
    assert "function.name" in refused(tools=[{"type": "function", "function": {"name": "a b"}}])
    assert "JSON schema is not usable" in refused(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nope"}}}])
    assert "two tools are named" in refused(tools=[TOOLS[0], TOOLS[0]])
    assert "tool_choice must be" in refused(tools=TOOLS, tool_choice="sometimes")
    assert "give one constraint" in refused(tools=TOOLS, tool_choice="required",
                                            response_format={"type": "json_object"})
    bad_call = {"id": "c", "type": "function",
                "function": {"name": "f", "arguments": "{oops"}}
    assert "not JSON" in refused(messages=[*ASK, {"role": "assistant",
                                                  "tool_calls": [bad_call]}])
    assert "older API" in refused(functions=[{"name": "f"}])


def test_parse_and_the_stream_filter():
    text = ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'
            '\n</tool_call>\n<tool_call>\n{"bad json\n</tool_call>')
    content, calls = parse(text)
    assert [c["function"] for c in calls] == [{"name": "get_time",
                                               "arguments": '{"zone": "UTC"}'}]
    assert content.startswith("Let me check.") and '{"bad json' in content
    assert parse("no calls here") == ("no calls here", [])
    assert parse('<tool_call>\n{"name": "f", "arguments": {"a":1}}\n</tool_call>')[1][0][
        "function"]["arguments"] == '{"a":1}'  # the model's own text of its arguments


def deltas_of(pieces: list[str]) -> tuple[str, dict[int, dict]]:
    """Content and calls (by index) that a client assembles from the stream filter."""
    stream = ToolStream()
    out = [d for p in pieces for d in stream.push(p)] + stream.finish()
    content, calls = "", {}
    for d in out:
        content += d.get("content") or ""
        for c in d.get("tool_calls", []):
            call = calls.setdefault(c["index"], {"name": "", "arguments": ""})
            if "id" in c:
                assert not call["name"] and c["type"] == "function"
                call["id"] = c["id"]
            call["name"] += c["function"].get("name", "")
            call["arguments"] += c["function"]["arguments"]
    return content, calls


def test_the_stream_filter_sends_calls_as_they_are_written():
    text = ('Hi <tool_call>\n{"name": "get_time", "arguments": {"zone": {"id": "UTC"}}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}"}}'
            '\n</tool_call>\n')
    want_content, want = parse(text)
    for size in (1, 2, 3, 7, len(text)):  # the same whatever the pieces
        content, calls = deltas_of([text[k:k + size] for k in range(0, len(text), size)])
        assert content == "Hi "
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (w["function"]["name"], w["function"]["arguments"]) for w in want]
        assert all(json.loads(c["arguments"]) for c in calls.values())
    # the name goes out before the call's block closes, and its arguments before their end
    stream = ToolStream()
    first = stream.push(text[:text.index('"zone"') + 12])
    assert first[0] == {"content": "Hi "}
    assert first[1]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert first[2]["tool_calls"][0]["function"]["arguments"].startswith('{"zone": {')
    # a block that is not a call is content; a plain "<table>" is never held for good
    assert deltas_of(["a <tool_call>\nnot json\n</tool_call> b"]) == (
        "a <tool_call>\nnot json\n</tool_call> b", {})
    plain = ToolStream()
    assert plain.push("a <t") == [{"content": "a "}]
    assert plain.push("able>") == [{"content": "<table>"}] and plain.finish() == []
    assert not plain.called
    cut = deltas_of(['<tool_call>\n{"name": "f", "arguments": {"a": [1, 2'])  # max_tokens
    assert cut == ("", {0: {"name": "f", "arguments": '{"a": [1, 2', "id": cut[1][0]["id"]}})


def test_tool_choice():
    assert Tools.of(TOOLS, "none", None) is None
    assert Tools.of(TOOLS, None, None).grammar() is None  # auto: not constrained
