"""Tool-call and reasoning parsers on outputs written the way the models emit them.

Every case is checked three ways: the whole-text extract against the expected content and calls;
the streaming extractor fed the text split at every character boundary (one split, and one
character at a time) and at every token boundary of the default model's tokenizer, whose deltas
must add up to exactly the whole-text result."""
from __future__ import annotations

import json

import pytest

from appliance.server.chat_tools import ChatOptions, ChatOutput, ToolChoice
from appliance.server.reasoning_parsers import get_reasoning_parser
from appliance.server.tool_parsers import TOOL_PARSERS, get_tool_parser

W = {"city": "Paris", "unit": "celsius"}

# (parser, output text, expected content, expected [(name, arguments as parsed JSON)])
CASES = [
    # Qwen 2.5 / Qwen 3 (hermes): blocks on their own lines, optionally after text.
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [("get_weather", W)]),
    ("hermes", 'Let me check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n'
               '</tool_call>', "Let me check both.", [("get_weather", W), ("get_time", {"tz": "Europe/Paris"})]),
    ("hermes", '<tool_call>\n{"name": "search", "arguments": {"q": "a } b { \\"quoted\\" </tool_call>", "n": 3, '
               '"opts": {"lang": ["fr", "東京"], "safe": true, "x": null}}}\n</tool_call>', None,
     [("search", {"q": 'a } b { "quoted" </tool_call>', "n": 3, "opts": {"lang": ["fr", "東京"], "safe": True,
                                                                         "x": None}})]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', None, [("get_time", {})]),
    ("hermes", '<tool_call>\n{"arguments": {"tz": "UTC"}, "name": "get_time"}\n</tool_call>', None,
     [("get_time", {"tz": "UTC"})]),
    ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>', None, [("get_time", {})]),
    ("hermes", "The weather in Paris is 18 °C.\n", "The weather in Paris is 18 °C.\n", []),
    ("hermes", "Wrap calls in <tool> tags, or <tool_calls>.", "Wrap calls in <tool> tags, or <tool_calls>.", []),
    ("hermes", "<tool_call>\nnot json at all\n</tool_call> ok", "<tool_call>\nnot json at all\n</tool_call> ok", []),
    ("hermes", 'Hi <tool_call>{"q": 1}</tool_call>', 'Hi <tool_call>{"q": 1}</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>\nDone.', "Done.",
     [("get_time", {"tz": "UTC"})]),
    # Llama 3.1 / 3.2 JSON: the whole output, after <|python_tag|> or not; several with ";".
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
     [("get_weather", W)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {"tz": "UTC"}}', None,
     [("get_weather", W), ("get_time", {"tz": "UTC"})]),
    ("llama3_json", "I cannot look that up, sorry.", "I cannot look that up, sorry.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", ' {"name": 7, "parameters": {}}', ' {"name": 7, "parameters": {}}', []),
    # Mistral: [TOOL_CALLS] then a JSON array.
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"tz": "UTC"}}]', None,
     [("get_weather", W), ("get_time", {"tz": "UTC"})]),
    ("mistral", '[TOOL_CALLS] [{"name":"get_time","arguments":{"tz":"UTC"}}]', None, [("get_time", {"tz": "UTC"})]),
    ("mistral", "Paris is in France. [1]", "Paris is in France. [1]", []),
    ("mistral", "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    ("mistral", "[TOOL_CALLS]oops", "[TOOL_CALLS]oops", []),
    # tokenizer v11+ (Mistral Small 3.2, Magistral): [TOOL_CALLS]name[ARGS]{...} per call
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]'
                '{"tz": "UTC"}', None, [("get_weather", W), ("get_time", {"tz": "UTC"})]),
    ("mistral", 'I will check. [TOOL_CALLS]get_time[ARGS]{}', "I will check.", [("get_time", {})]),
    ("mistral", "[TOOL_CALLS]get_time[ARGS]not json", "[TOOL_CALLS]get_time[ARGS]not json", []),
    # Pythonic (Llama 3.2 / 4): a Python list of calls, parsed with ast.
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), get_time(tz=\'UTC\')]', None,
     [("get_weather", W), ("get_time", {"tz": "UTC"})]),
    ("pythonic", '<|python_start|>[search(q="f(x) = [1, 2]", opts={"lang": ["fr"], "n": 2}, safe=True, x=None, '
                 'f=1.5)]<|python_end|>', None,
     [("search", {"q": "f(x) = [1, 2]", "opts": {"lang": ["fr"], "n": 2}, "safe": True, "x": None, "f": 1.5})]),
    ("pythonic", "[get_time()]", None, [("get_time", {})]),
    ("pythonic", "[1, 2, 3] are the first numbers.", "[1, 2, 3] are the first numbers.", []),
    ("pythonic", "[Note] f(x) is here", "[Note] f(x) is here", []),
    ("pythonic", "[get_time() + 1]", "[get_time() + 1]", []),
    ("pythonic", '[get_weather("Paris")]', '[get_weather("Paris")]', []),  # positional: not a tool call
    ("pythonic", "[f(x=__import__('os'))]", "[f(x=__import__('os'))]", []),  # never evaluated
    ("pythonic", "The answer is 4.", "The answer is 4.", []),
]


def _ids(case):
    return f"{case[0]}-{case[1][:30]!r}"


def collect(deltas):
    """Content and calls from streamed deltas, checking the delta protocol on the way."""
    content, calls = "", []
    for d in deltas:
        assert set(d) <= {"content", "tool_calls"}, d
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            i = tc["index"]
            if i == len(calls):
                assert tc["id"].startswith("call_") and len(tc["id"]) > 10 and tc["type"] == "function", tc
                assert tc["function"]["arguments"] == "", tc  # the name first, arguments after
                calls.append([tc["id"], tc["function"]["name"], ""])
            else:
                assert i < len(calls) and set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
                calls[i][2] += tc["function"]["arguments"]
    return content, calls


def stream(parser, pieces):
    s = parser.streamer()
    deltas = []
    for p in pieces:
        deltas += s.feed(p)
    deltas += s.finish()
    return collect(deltas)


def check_whole(parser, text, content, calls):
    r = parser.extract(text)
    assert r.content == content
    assert [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == calls
    assert all(c.id.startswith("call_") for c in r.tool_calls)
    assert len({c.id for c in r.tool_calls}) == len(r.tool_calls)
    return r


def check_stream(parser, r, pieces):
    content, calls = stream(parser, pieces)
    assert content == (r.content or ""), pieces
    assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in r.tool_calls], pieces


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_whole_and_streamed_at_every_character(case):
    name, text, content, calls = case
    parser = get_tool_parser(name)
    r = check_whole(parser, text, content, calls)
    for i in range(len(text) + 1):
        check_stream(parser, r, [text[:i], text[i:]])
    check_stream(parser, r, list(text))


@pytest.fixture(scope="module")
def default_tokenizer():
    from transformers import AutoTokenizer

    from appliance.models.default_model import resolve_model_source, tokenizer_path

    return AutoTokenizer.from_pretrained(str(tokenizer_path(resolve_model_source(None))))


def token_pieces(tok, text):
    """The text as the server streams it: the decoded text grown one token at a time."""
    ids = tok.encode(text, add_special_tokens=False)
    pieces, prev = [], ""
    for k in range(1, len(ids) + 1):
        cur = tok.decode(ids[:k], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if cur.endswith("\ufffd"):
            continue  # an incomplete UTF-8 sequence is held back, as the detokenizer does
        pieces.append(cur[len(prev):])
        prev = cur
    assert prev == text
    return pieces


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_streamed_at_every_token_of_the_default_tokenizer(case, default_tokenizer):
    name, text, content, calls = case
    parser = get_tool_parser(name)
    check_stream(parser, check_whole(parser, text, content, calls), token_pieces(default_tokenizer, text))


def test_registry_names():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral", "pythonic"]
    with pytest.raises(ValueError, match="--tool-call-parser must be one of .*got 'nope'"):
        get_tool_parser("nope")


def test_truncated_call_streams_what_it_has():
    """An output cut inside the arguments (max_tokens) keeps the call with the text it got, both ways."""
    p = get_tool_parser("hermes")
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    r = p.extract(text)
    assert r.content is None and [(c.name, c.arguments) for c in r.tool_calls] == [("get_weather", '{"city": "Par')]
    for i in range(len(text) + 1):
        check_stream(p, r, [text[:i], text[i:]])


# -- reasoning -----------------------------------------------------------------------------------------

REASONING = [
    # DeepSeek-R1: the template opened <think>; the model writes the reasoning, </think>, the answer.
    ("deepseek_r1", "The user asks 2+2. That is 4.\n</think>\n\nThe answer is 4.", "The user asks 2+2. That is 4.\n",
     "\n\nThe answer is 4."),
    ("deepseek_r1", "<think>\nHmm, 2+2.\n</think>4", "\nHmm, 2+2.\n", "4"),
    ("deepseek_r1", "Still thinking about <b> and </thi", "Still thinking about <b> and </thi", None),
    # Qwen3: reasoning only when the output opens with <think>.
    ("qwen3", "<think>\nParis is the capital.\n</think>\n\nParis.", "\nParis is the capital.\n", "\n\nParis."),
    ("qwen3", "Paris.", None, "Paris."),
    ("qwen3", "  <thinking> is a tag", None, "  <thinking> is a tag"),
    ("qwen3", "<think>\ncut short", "\ncut short", None),
]


@pytest.mark.parametrize("case", REASONING, ids=lambda c: f"{c[0]}-{c[1][:20]!r}")
def test_reasoning_whole_and_streamed(case, default_tokenizer):
    name, text, reasoning, content = case
    p = get_reasoning_parser(name)
    assert p.extract(text) == (reasoning, content)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text), token_pieces(default_tokenizer, text)]
    for pieces in splits:
        s = p.streamer()
        r = c = ""
        for piece in pieces:
            dr, dc = s.feed(piece)
            r, c = r + dr, c + dc
        dr, dc = s.finish()
        assert (r + dr or None, c + dc or None) == (reasoning, content), pieces


def chat_output_stream(out, pieces):
    deltas = []
    for i, p in enumerate(pieces):
        deltas += out.feed(p, final=i == len(pieces) - 1)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content, calls = collect([{k: v for k, v in d.items() if k != "reasoning_content"} for d in deltas])
    return reasoning, content, calls


def test_reasoning_then_tool_call_whole_and_streamed(default_tokenizer):
    """Qwen3 thinking, then a hermes tool call: tool parsing applies to the content part only."""
    opts = ChatOptions(tool_parser=get_tool_parser("hermes"), enable_auto_tool_choice=True,
                       reasoning_parser=get_reasoning_parser("qwen3"))
    text = ('<think>\nI should call <tool_call> get_weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>')
    msg = ChatOutput(opts, ToolChoice("auto")).message(text)
    assert msg["reasoning_content"] == "\nI should call <tool_call> get_weather.\n"
    assert msg["content"] is None
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in msg["tool_calls"]] == \
        [("get_weather", '{"city": "Paris"}')]
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [token_pieces(default_tokenizer, text)]:
        r, c, calls = chat_output_stream(ChatOutput(opts, ToolChoice("auto")), pieces)
        assert (r, c) == (msg["reasoning_content"], "")
        assert [(n, a) for _, n, a in calls] == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("mode,text,calls", [
    (ToolChoice("named", "get_weather"), ' {"city": "Paris", "unit": "celsius"} ', [("get_weather", W)]),
    (ToolChoice("required"), '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
                             '{"name": "get_time", "parameters": {}}]', [("get_weather", W), ("get_time", {})]),
])
def test_enforced_tool_choice_output(mode, text, calls):
    """The JSON that tool_choice "required" / named constrains the output to, whole and streamed; the
    reasoning parser stays out of it (the constrained output has no reasoning)."""
    opts = ChatOptions(reasoning_parser=get_reasoning_parser("deepseek_r1"))
    msg = ChatOutput(opts, mode).message(text)
    assert msg["content"] is None and msg["reasoning_content"] is None
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in msg["tool_calls"]] == calls
    for i in range(len(text) + 1):
        r, c, got = chat_output_stream(ChatOutput(opts, mode), [text[:i], text[i:]])
        assert (r, c) == ("", "")
        assert [(n, a) for _, n, a in got] == [(t["function"]["name"], t["function"]["arguments"])
                                                for t in msg["tool_calls"]]
