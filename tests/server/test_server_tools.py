"""Tool calling, reasoning and chat-template options against live `appliance serve` subprocesses
(tiny llama, float32), driven with the official `openai` client.

The tools server renders a Qwen 2.5-style template from a file (--chat-template FILE) and parses
hermes tool calls; the reasoning server renders a DeepSeek-R1-style template given as a string
(--chat-template STRING) that opens <think>, with --reasoning-parser deepseek_r1 and
--default-chat-template-kwargs."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from appliance.server.reasoning_parsers import get_reasoning_parser
from chat_templates import QWEN25_STYLE, R1_STYLE
from conftest import REPO

NAME = "tiny"
COMMON = ("--served-model-name", NAME, "--dtype", "float32", "--num-kv-blocks", "512", "--max-num-seqs", "16")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
ROUND_TRIP = USER + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc123", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc123", "content": "18 degrees and sunny"},
]
# Enforcement (structured outputs) lives in appliance.structured, built on the `structured` branch.
STRUCTURED = importlib.util.find_spec("appliance.structured") is not None
needs_structured = pytest.mark.skipif(not STRUCTURED, reason="tool_choice required/named is enforced through "
                                      "appliance.structured, which this branch has not merged yet")


@pytest.fixture(scope="module")
def long_model_dir(tiny_model_dir):
    # The tiny tokenizer (384 byte-level tokens) makes a prompt with tool schemas ~1200 tokens long.
    return tiny_model_dir("llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def tools_server(start_server, long_model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "qwen25_style.jinja"
    template.write_text(QWEN25_STYLE)
    srv = start_server(long_model_dir, *COMMON, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--chat-template", str(template))
    yield srv
    assert srv.stop() == 0, srv.output()
    assert "Traceback" not in srv.output(), srv.output()


@pytest.fixture(scope="module")
def client(tools_server):
    return openai.OpenAI(base_url=f"{tools_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(tools_server):
    with httpx.Client(base_url=tools_server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tok(server_model_dir):
    return AutoTokenizer.from_pretrained(str(server_model_dir))


def rendered(http, tok, messages, **kw) -> str:
    r = http.post("/tokenize", json={"messages": messages, **kw})
    assert r.status_code == 200, r.text
    return tok.decode(r.json()["tokens"])


def test_template_receives_the_tools(http, tok):
    text = rendered(http, tok, USER, tools=TOOLS)
    for t in TOOLS:  # the template's `tool | tojson`
        assert json.dumps(t, ensure_ascii=False) in text
    assert "<tools>" in text and text.endswith("<|im_start|>assistant\n")
    assert "<tools>" not in rendered(http, tok, USER)


def test_tool_round_trip(client, http, tok):
    text = rendered(http, tok, ROUND_TRIP, tools=TOOLS)
    # arguments reach the template as a dict (tojson of it is the object, not a quoted string)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' \
        in text
    assert "<|im_start|>user\n<tool_response>\n18 degrees and sunny\n</tool_response><|im_end|>" in text
    n_prompt = http.post("/tokenize", json={"messages": ROUND_TRIP, "tools": TOOLS}).json()["count"]
    r = client.chat.completions.create(model=NAME, messages=ROUND_TRIP, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == n_prompt


def _bad(client, match, param, **kw):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, max_tokens=4, **{"messages": USER, **kw})
    err = e.value.body
    assert match in err["message"], err
    assert err["param"] == param, err
    assert e.value.status_code == 400


def test_bad_requests_are_400s_naming_the_field(client):
    _bad(client, "tool_choice.function.name: 'x' is not one of the request's tools ['get_weather', 'get_time']",
         "tool_choice.function.name", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}})
    bad_id = USER + [ROUND_TRIP[1], {**ROUND_TRIP[2], "tool_call_id": "call_nope"}]
    _bad(client, "messages[2].tool_call_id: 'call_nope' matches no tool call of an earlier assistant message",
         "messages.2.tool_call_id", messages=bad_id, tools=TOOLS)
    _bad(client, "tools[1].function.name", "tools.1.function.name",
         tools=[WEATHER, {"type": "function", "function": {"description": "no name"}}])
    _bad(client, "tools[0].function.parameters: is not a valid JSON schema", "tools.0.function.parameters",
         tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}])
    _bad(client, "tool_choice='required' needs tools", "tool_choice", tool_choice="required")
    bad_args = USER + [{**ROUND_TRIP[1], "tool_calls": [{**ROUND_TRIP[1]["tool_calls"][0],
                                                          "function": {"name": "get_weather", "arguments": "{oops"}}]}]
    _bad(client, "messages[1].tool_calls[0].function.arguments must be a JSON object text",
         "messages.1.tool_calls.0.function.arguments", messages=bad_args, tools=TOOLS)
    _bad(client, "chat_template_kwargs.tokenize: may not be set", "chat_template_kwargs.tokenize",
         extra_body={"chat_template_kwargs": {"tokenize": True}})
    # and the server keeps serving
    r = client.chat.completions.create(model=NAME, messages=USER, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def _stream(client, **kw):
    content, calls, finish = "", {}, None
    for ch in client.chat.completions.create(model=NAME, stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                assert tc.id.startswith("call_") and tc.function.name and tc.type == "function"
                calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
            else:
                assert tc.id is None and not tc.function.name
                calls[tc.index][1] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, [tuple(v) for _, v in sorted(calls.items())], finish


def test_auto_stream_matches_non_stream(client):
    """tool_choice auto (the default with tools): the hermes parser runs over the output, streamed
    and not; greedy, so both see the same text."""
    kw = dict(messages=USER, tools=TOOLS, max_tokens=24, temperature=0)
    r = client.chat.completions.create(model=NAME, **kw)
    m = r.choices[0].message
    calls = [(t.function.name, t.function.arguments) for t in m.tool_calls or []]
    assert _stream(client, **kw) == (m.content or "", calls, r.choices[0].finish_reason)


def test_tool_choice_none_keeps_tools_in_prompt_but_parses_nothing(client, http):
    n_with = http.post("/tokenize", json={"messages": USER, "tools": TOOLS}).json()["count"]
    r = client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.usage.prompt_tokens == n_with
    assert r.choices[0].message.tool_calls is None


def _check_call(name, arguments):
    fn = {t["function"]["name"]: t["function"] for t in TOOLS}[name]
    jsonschema.validate(json.loads(arguments), fn["parameters"])


@needs_structured
@pytest.mark.parametrize("seed", range(4))
def test_named_tool_choice_always_calls_it(client, seed):
    r = client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, temperature=1.0, seed=seed,
                                       max_tokens=120,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert len(c.message.tool_calls) == 1 and c.message.tool_calls[0].function.name == "get_weather"
    _check_call("get_weather", c.message.tool_calls[0].function.arguments)


@needs_structured
@pytest.mark.parametrize("seed", range(4))
def test_required_tool_choice_always_calls_a_tool(client, seed):
    # parallel_tool_calls=False: exactly one call, so the output's length is bounded by the schema
    r = client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, temperature=1.0, seed=seed,
                                       max_tokens=200, tool_choice="required", parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    _check_call(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)


@needs_structured
def test_required_tool_choice_parallel_calls(client):
    r = client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, temperature=1.0, seed=1,
                                       max_tokens=1500, tool_choice="required")
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) >= 1
    assert len({t.id for t in c.message.tool_calls}) == len(c.message.tool_calls)
    for t in c.message.tool_calls:
        _check_call(t.function.name, t.function.arguments)


@needs_structured
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_enforced_tool_choice_streams_the_same_call(client, choice):
    kw = dict(messages=USER, tools=TOOLS, temperature=1.0, seed=7, max_tokens=200, tool_choice=choice,
              parallel_tool_calls=False)
    r = client.chat.completions.create(model=NAME, **kw)
    want = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
    content, calls, finish = _stream(client, **kw)
    assert (content, calls, finish) == ("", want, "tool_calls")
    for name, args in calls:
        _check_call(name, args)


# -- reasoning and chat-template options --------------------------------------------------------------

@pytest.fixture(scope="module")
def r1_server(start_server, server_model_dir):
    srv = start_server(server_model_dir, *COMMON, "--reasoning-parser", "deepseek_r1", "--chat-template", R1_STYLE,
                       "--default-chat-template-kwargs", '{"persona": "pirate"}')
    yield srv
    assert srv.stop() == 0, srv.output()
    assert "Traceback" not in srv.output(), srv.output()


def test_chat_template_kwargs_default_and_request(r1_server, tok):
    with httpx.Client(base_url=r1_server.base_url, timeout=60) as h:
        assert rendered(h, tok, USER).startswith("[pirate]<|user|>What is")
        assert rendered(h, tok, USER, chat_template_kwargs={"persona": "robot"}).startswith("[robot]<|user|>")
        assert rendered(h, tok, USER).endswith("<|assistant|><think>\n")


def test_reasoning_streamed_equals_non_streamed(r1_server, tok):
    client = openai.OpenAI(base_url=f"{r1_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model=NAME, messages=USER, max_tokens=24, temperature=0)
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message.model_dump()
    # The reference: the same prompt as a plain completion, split by the parser.
    with httpx.Client(base_url=r1_server.base_url, timeout=60) as h:
        prompt = rendered(h, tok, USER)
    raw = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    reasoning, content = get_reasoning_parser("deepseek_r1").extract(raw)
    assert reasoning  # the template opened <think>: the output is reasoning
    assert (m["reasoning_content"], m["content"]) == (reasoning, content)
    r_s = c_s = ""
    for ch in client.chat.completions.create(stream=True, **kw):
        if ch.choices:
            d = ch.choices[0].delta.model_dump()
            r_s += d.get("reasoning_content") or ""
            c_s += d.get("content") or ""
    assert (r_s, c_s) == (reasoning, content or "")


@pytest.mark.parametrize("args,match", [
    (["--chat-template", "{% if %}"], "--chat-template: the string (not an existing file) is not a valid Jinja"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--tool-call-parser", "nope"], "--tool-call-parser must be one of"),
    (["--reasoning-parser", "nope"], "--reasoning-parser must be one of ['deepseek_r1', 'qwen3'], got 'nope'"),
    (["--default-chat-template-kwargs", "[1]"], "--default-chat-template-kwargs must be a JSON object"),
])
def test_bad_chat_flags_fail_at_start(args, match, tmp_path):
    p = subprocess.run([sys.executable, "-m", "appliance.cli", "serve", "--port", "1", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and match in p.stderr, p.stderr


def test_bad_chat_template_file_names_the_file(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for %}")
    p = subprocess.run([sys.executable, "-m", "appliance.cli", "serve", "--port", "1", "--chat-template", str(f)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and f"--chat-template: the file {f} is not a valid Jinja template" in p.stderr, p.stderr


def test_auto_tool_choice_without_the_flags_is_a_400(r1_server):
    client = openai.OpenAI(base_url=f"{r1_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    for choice in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, max_tokens=4, **choice)
        assert "--enable-auto-tool-choice" in e.value.body["message"] and e.value.body["param"] == "tool_choice"
    # "none" needs no parser, and the server keeps serving
    r = client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None


# The output forced (structured outputs, a regex) into Qwen's tool-call format, so tool_choice
# "auto" meets real <tool_call> blocks: the hermes parser finds them, streamed and not.
HERMES_REGEX = (r'[A-Z][a-z]{0,6}\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,8}", '
                r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>\n<tool_call>\n\{"name": "get_time", "arguments": '
                r'\{"tz": "(UTC|CET)"\}\}\n</tool_call>')


@needs_structured
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 3)])
def test_auto_parses_real_tool_call_blocks(client, temperature, seed):
    kw = dict(messages=USER, tools=TOOLS, max_tokens=300, temperature=temperature, seed=seed,
              extra_body={"structured_outputs": {"regex": HERMES_REGEX}})
    r = client.chat.completions.create(model=NAME, **kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content and c.message.content.endswith(".") and "\n" not in c.message.content
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather", "get_time"]
    for t in c.message.tool_calls:
        _check_call(t.function.name, t.function.arguments)
    want = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    assert _stream(client, **kw) == (c.message.content, want, "tool_calls")


def test_chat_flags_from_config_file(tmp_path):
    f = tmp_path / "serve.yaml"
    f.write_text("enable-auto-tool-choice: true\ntool-call-parser: nope\n")
    p = subprocess.run([sys.executable, "-m", "appliance.cli", "serve", "--port", "1", "--config", str(f)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--tool-call-parser must be one of" in p.stderr, p.stderr
