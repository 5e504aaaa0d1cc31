"""tool_choice "required" and a named function on the default model (SmolLM2-135M-Instruct, a
ChatML model, served with the Qwen 2.5-style tool template): at temperature 1, every seed gives a
call whose arguments validate against the function's parameters schema."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from chat_templates import QWEN25_STYLE
from test_server_tools import TOOLS, USER, needs_structured

pytestmark = needs_structured


@pytest.fixture(scope="module")
def client(start_server, tmp_path_factory):
    from appliance.models.default_model import default_gguf_path

    template = tmp_path_factory.mktemp("tpl") / "qwen25_style.jinja"
    template.write_text(QWEN25_STYLE)
    srv = start_server(default_gguf_path(), "--served-model-name", "default", "--dtype", "float32",
                       "--max-model-len", "2048", "--num-kv-blocks", "256", "--max-num-seqs", "4",
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(template))
    yield openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    assert srv.stop() == 0, srv.output()
    assert "Traceback" not in srv.output(), srv.output()


def _valid(call):
    fn = {t["function"]["name"]: t["function"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                    {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named-get_weather", "named-get_time"])
def test_enforced_tool_choice_always_gives_a_valid_call(client, choice, seed):
    r = client.chat.completions.create(model="default", messages=USER, tools=TOOLS, tool_choice=choice,
                                       temperature=1.0, seed=seed, max_tokens=120, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    assert len(c.message.tool_calls) == 1
    if isinstance(choice, dict):
        assert c.message.tool_calls[0].function.name == choice["function"]["name"]
    _valid(c.message.tool_calls[0])
