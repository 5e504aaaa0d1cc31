"""Request checks and the tool_choice schema of appliance.server.chat_tools."""
from __future__ import annotations

import jsonschema
import pytest

from appliance.errors import ApplianceError
from appliance.server.chat_tools import (
    ChatOptions, check_tool_choice, check_tool_messages, check_tools, load_chat_template, template_kwargs,
    tool_choice_schema,
)
from appliance.server.protocol import ChatCompletionRequest, OpenAIError
from appliance.server.tool_parsers import get_tool_parser

A = {"type": "function", "function": {"name": "a", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}}}
B = {"type": "function", "function": {"name": "b", "description": "no parameters"}}
AUTO = ChatOptions(tool_parser=get_tool_parser("hermes"), enable_auto_tool_choice=True)


def err(fn, *a):
    with pytest.raises(OpenAIError) as e:
        fn(*a)
    assert e.value.status == 400
    return e.value


def test_check_tools_normalises_and_names_bad_fields():
    tools = check_tools([A, B])
    assert tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert check_tools(None) is None
    e = err(check_tools, [A, {"type": "function", "function": {"name": "has space"}}])
    assert e.param == "tools.1.function.name" and "'has space'" in e.message
    assert err(check_tools, [A, A]).message == "tools[1].function.name: 'a' is given twice"
    assert err(check_tools, [{"type": "retrieval"}]).param == "tools.0.type"
    assert err(check_tools, [{"type": "function"}]).param == "tools.0.function"
    e = err(check_tools, [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}])
    assert e.param == "tools.0.function.parameters" and "not a valid JSON schema" in e.message


def test_tool_choice_modes():
    tools = check_tools([A, B])
    assert check_tool_choice(None, tools, AUTO).mode == "auto"
    assert check_tool_choice(None, None, ChatOptions()).mode == "none"
    assert check_tool_choice("none", tools, ChatOptions()).mode == "none"
    assert check_tool_choice("required", tools, ChatOptions()).mode == "required"
    named = check_tool_choice({"type": "function", "function": {"name": "b"}}, tools, ChatOptions())
    assert (named.mode, named.name) == ("named", "b")
    # auto needs the server flags, as vLLM: the default with tools too
    for choice in (None, "auto"):
        e = err(check_tool_choice, choice, tools, ChatOptions())
        assert "--enable-auto-tool-choice" in e.message and "--tool-call-parser" in e.message
    e = err(check_tool_choice, {"type": "function", "function": {"name": "x"}}, tools, AUTO)
    assert e.message == "tool_choice.function.name: 'x' is not one of the request's tools ['a', 'b']"
    assert e.param == "tool_choice.function.name"
    assert err(check_tool_choice, "maybe", tools, AUTO).param == "tool_choice"
    assert err(check_tool_choice, "required", None, AUTO).param == "tool_choice"


def test_tool_messages_must_answer_an_earlier_call():
    def msgs(*m):
        return ChatCompletionRequest(messages=list(m)).messages

    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}}]}
    check_tool_messages(msgs({"role": "user", "content": "q"}, call, {"role": "tool", "tool_call_id": "c1",
                                                                       "content": "1"}))
    e = err(check_tool_messages, msgs({"role": "tool", "tool_call_id": "c1", "content": "1"}, call))
    assert e.param == "messages.0.tool_call_id"  # the call comes later: no match
    assert err(check_tool_messages, msgs(call, {"role": "tool", "content": "1"})).param == "messages.1.tool_call_id"


def test_tool_choice_schema_accepts_exactly_the_tools():
    tools = check_tools([A, B])
    named = tool_choice_schema(check_tool_choice({"type": "function", "function": {"name": "a"}}, tools, AUTO), tools)
    jsonschema.validate({"x": 3}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"x": "3"}, named)
    req = tool_choice_schema(check_tool_choice("required", tools, AUTO), tools)
    jsonschema.validate([{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}], req)
    for bad in ([], [{"name": "c", "parameters": {}}], [{"name": "a", "parameters": {}}],
                [{"name": "a", "parameters": {"x": 1}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, req)
    one = tool_choice_schema(check_tool_choice("required", tools, AUTO), tools, parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "b", "parameters": {}}] * 2, one)


def test_chat_options_flags(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}")
    assert ChatOptions.from_flags(chat_template=str(f)).chat_template == "{{ messages[0].content }}"
    assert ChatOptions.from_flags(chat_template="{{ 1 }}").chat_template == "{{ 1 }}"
    assert load_chat_template(None) is None
    with pytest.raises(ApplianceError, match="--chat-template: the string"):
        ChatOptions.from_flags(chat_template="{% endfor %}")
    opts = ChatOptions.from_flags(default_chat_template_kwargs='{"enable_thinking": false, "x": 1}')
    assert template_kwargs(opts, {"enable_thinking": True}) == {"enable_thinking": True, "x": 1}
    assert template_kwargs(opts, None) == {"enable_thinking": False, "x": 1}
    with pytest.raises(ApplianceError, match="may not set"):
        ChatOptions.from_flags(default_chat_template_kwargs={"tools": []})
    assert err(template_kwargs, opts, {"add_generation_prompt": False}).param == \
        "chat_template_kwargs.add_generation_prompt"


def test_parallel_tool_calls_false_keeps_the_first_parsed_call():
    from appliance.server.chat_tools import ChatOutput, ToolChoice

    text = ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')
    both = ChatOutput(AUTO, ToolChoice("auto")).message(text)["tool_calls"]
    assert [t["function"]["name"] for t in both] == ["a", "b"]
    one = ChatOutput(AUTO, ToolChoice("auto"), parallel_tool_calls=False)
    assert [t["function"]["name"] for t in one.message(text)["tool_calls"]] == ["a"]
    deltas = [d for i in range(len(text)) for d in one.feed(text[i], final=i == len(text) - 1)]
    assert {tc["index"] for d in deltas for tc in d.get("tool_calls", [])} == {0}
