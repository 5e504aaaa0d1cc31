"""Structured outputs and logit_bias over HTTP, against a live `appliance serve` on the default model
(SmolLM2-135M GGUF), with the official openai client: response_format (json_schema, json_object),
vLLM's structured_outputs and guided_* fields, 400s naming the field for bad constraints (the server
keeps serving), and logit_bias checked against the model's own ranking (logprobs)."""
from __future__ import annotations

import json
import re

import jsonschema
import httpx
import openai
import pytest

from appliance.models.default_model import default_gguf_path

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(start_server):
    srv = start_server(default_gguf_path(), "--served-model-name", "smol", "--dtype", "float32", "--max-model-len", "1024",
                       "--num-kv-blocks", "256", "--seed", "0")
    yield srv
    code = srv.stop()
    assert code == 0, srv.output()
    assert "Traceback" not in srv.output(), srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, content="Describe a person as JSON.", **kw):
    return client.chat.completions.create(model="smol", messages=[{"role": "user", "content": content}], **kw)


def test_response_format_json_schema_chat(client):
    r = chat(client, n=3, temperature=1.0, max_tokens=80,
             response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                     "strict": True}})
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), PERSON)


def test_response_format_json_schema_streamed(client):
    stream = chat(client, temperature=1.0, max_tokens=80, stream=True,
                  response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    chunks = [ch.choices[0] for ch in stream if ch.choices]
    text = "".join(c.delta.content or "" for c in chunks)
    assert chunks[-1].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), PERSON)


def test_response_format_json_object(client):
    # Any JSON object is unbounded (at temperature 1 a key can run past any max_tokens, greedy loops):
    # complete objects are checked offline with a seed (tests/model/test_structured_outputs.py); here
    # the start of the answer, which unconstrained would be prose.
    r = chat(client, content="Tell me about cats.", temperature=1.0, max_tokens=3, n=4,
             response_format={"type": "json_object"})
    for c in r.choices:
        assert c.message.content.startswith("{"), c.message.content


def test_completions_structured_outputs_and_guided_aliases(client):
    def complete(prompt, **extra):
        return client.completions.create(model="smol", prompt=prompt, temperature=1.0, max_tokens=40, n=2,
                                         extra_body=extra).choices

    for c in complete("Phone:", structured_outputs={"regex": r"\d{3}-\d{4}"}):
        assert re.fullmatch(r"\d{3}-\d{4}", c.text), c.text
    for c in complete("Pick:", guided_choice=["alpha", "beta"]):
        assert c.text in ("alpha", "beta")
    for c in complete("Person:", guided_json=PERSON):
        jsonschema.validate(json.loads(c.text), PERSON)
    for c in complete("Code:", guided_regex=r"[A-Z]{3}"):
        assert re.fullmatch(r"[A-Z]{3}", c.text)
    for c in complete("Answer:", guided_grammar='root ::= "yes" | "no"'):
        assert c.text in ("yes", "no")
    for c in complete("Person:", response_format={"type": "json_schema", "json_schema": {"name": "p",
                                                                                        "schema": PERSON}}):
        jsonschema.validate(json.loads(c.text), PERSON)


@pytest.mark.parametrize("body, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
        "required": ["a"]}}}},
     "response_format.json_schema.schema", "required property 'a' is unsatisfiable"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "response_format.json_schema.schema", "'/nope' does not exist"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", 'unknown name: "foo"'),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
    ({"guided_regex": "(("}, "guided_regex", "unclosed group"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_grammar": 'root ::= "a" | ('}, "guided_grammar", "GBNF"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "only one of"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "logit_bias[5] must be a number in [-100, 100], got 101"),
    ({"logit_bias": {"49152": 1}}, "logit_bias", "logit_bias token ids must be in [0, 49152), got [49152]"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "non-negative token ids, got 'abc'"),
])
def test_bad_constraints_are_400s_naming_the_field(client, body, param, fragment):
    for call in (lambda: chat(client, max_tokens=5, extra_body=body),
                 lambda: client.completions.create(model="smol", prompt="x", max_tokens=5, extra_body=body)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.status_code == 400
        err = e.value.body
        assert err["param"] == param and fragment in err["message"], err
    # and the server still serves
    assert chat(client, max_tokens=3, temperature=0).choices[0].finish_reason in ("stop", "length")


def test_logit_bias_over_http(client):
    prompt = "The capital of France is"
    top = client.completions.create(model="smol", prompt=prompt, max_tokens=1, temperature=0, logprobs=5)
    lp = top.choices[0].logprobs.top_logprobs[0]  # token string -> logprob, the model's raw ranking
    ranked = sorted(lp.items(), key=lambda kv: -kv[1])
    assert top.choices[0].text == ranked[0][0]
    first = client.completions.create(model="smol", prompt=prompt, max_tokens=1, temperature=0,
                                      logprobs=0).choices[0]
    # token ids through the tokenize endpoint: ban the best token, the second best comes out
    base = str(client.base_url).removesuffix("/v1/")
    tid = httpx.post(f"{base}/tokenize", json={"model": "smol", "prompt": first.text,
                                               "add_special_tokens": False}).json()["tokens"]
    assert len(tid) == 1
    banned = client.completions.create(model="smol", prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={str(tid[0]): -100})
    assert banned.choices[0].text == ranked[1][0]
    forced_id = httpx.post(f"{base}/tokenize", json={"model": "smol", "prompt": " banana",
                                                     "add_special_tokens": False}).json()["tokens"][0]
    forced = client.completions.create(model="smol", prompt=prompt, max_tokens=3, temperature=1.0,
                                       logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == " banana" * 3
