"""Structured outputs through the engine on the default model (SmolLM2-135M GGUF) at temperature 1:
every sampled output parses and validates (jsonschema for 20 schemas, re.fullmatch for regexes, the
choice list), n > 1 sequences each follow the grammar, a preempted constrained request still does,
free greedy requests batched with constrained ones give the same tokens as alone, and logit_bias
forces and bans tokens.

The schemas are bounded (maxLength, maxItems, enums, min/max, additionalProperties false) so that
each output ends well inside max_tokens: the grammar forces validity, not brevity."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from appliance import LLM, SamplingParams
from appliance.errors import InvalidRequestError
from appliance.sampling_params import StructuredOutputsParams

NAME = {"type": "string", "maxLength": 12}

SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -10, "maximum": 10}, "y": {"type": "integer", "minimum": -10, "maximum": 10}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"],
     "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2,3}-[0-9]{1,3}$", "maxLength": 7}},
     "required": ["code"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, NAME]}},
     "required": ["id"], "additionalProperties": False},
    {"type": "object", "properties": {"name": NAME, "nick": NAME}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["score"], "additionalProperties": False},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]},
                                      "mode": {"const": "fast"}}, "required": ["level", "mode"],
     "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[a-z]{3}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "boolean"}, {"type": "null"},
                                                          {"type": "integer", "minimum": 0, "maximum": 9}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "string", "enum": ["yes", "no", "unsure"]},
    {"type": "integer", "minimum": 100, "maximum": 200},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": NAME, "address": {"type": "object", "properties": {"city": NAME, "zip": {"type": "string",
                                                                                           "pattern": "^[0-9]{4}$"}},
                                  "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"temp": {"type": "number", "minimum": -50, "maximum": 50},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["temp", "unit"],
     "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "minLength": 2, "maxLength": 8},
                                      "pages": {"type": "integer", "minimum": 1, "maximum": 500},
                                      "draft": {"type": "boolean"}},
     "required": ["title", "pages"], "additionalProperties": False},
]
assert len(SCHEMAS) == 20


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=1024, kv_cache_memory=0.25, seed=0)


def sample(**kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, **kw)


def texts(out) -> list[str]:
    return [c.text for c in out.outputs]


def test_json_schemas_validate(llm):
    prompts = [f"Reply with JSON matching this schema: {json.dumps(s)}\n" for s in SCHEMAS]
    params = [sample(n=2, max_tokens=120, structured_outputs=StructuredOutputsParams(json=s)) for s in SCHEMAS]
    for schema, out in zip(SCHEMAS, llm.generate(prompts, params)):
        for c in out.outputs:
            assert c.finish_reason == "stop", (schema, c.text)
            jsonschema.validate(json.loads(c.text), schema)
            assert c.token_ids[-1] in llm.engine.eos_token_ids  # ended by EOS, once the grammar allowed it


def test_json_object_regex_choice(llm):
    regexes = [r"\d{3}-\d{4}", r"(cat|dog)s? [a-z]{1,8}", r"[A-Z][a-z]{2,6}, [A-Z]{2}"]
    choices = ["Paris", "London", "New York City"]
    prompts = ["A JSON object:", "Phone number:", "Pets:", "City and state:", "The capital of France is"]
    # Any JSON object is unbounded: seeded (the draw does not depend on the batch) with room to finish.
    params = [sample(n=2, max_tokens=200, seed=7, structured_outputs=StructuredOutputsParams(json_object=True))]
    params += [sample(n=2, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=r)) for r in regexes]
    params += [sample(n=3, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=choices))]
    outs = llm.generate(prompts, params)
    for c in outs[0].outputs:
        assert c.finish_reason == "stop" and isinstance(json.loads(c.text), dict), c.text
    for r, out in zip(regexes, outs[1:4]):
        for t in texts(out):
            assert re.fullmatch(r, t), (r, t)
    assert all(t in choices for t in texts(outs[4])), texts(outs[4])


def test_lark_and_gbnf_grammars(llm):
    lark = 'start: "sum(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'
    gbnf = 'root ::= "answer: " ("yes" | "no")'
    outs = llm.generate(["Write a sum:", "Answer:"], [
        sample(n=2, max_tokens=40, structured_outputs=StructuredOutputsParams(grammar=lark)),
        sample(n=2, max_tokens=20, structured_outputs=StructuredOutputsParams(grammar=gbnf))])
    assert all(re.fullmatch(r"sum\([0-9]{1,3}(,[0-9]{1,3})*\)", t) for t in texts(outs[0])), texts(outs[0])
    assert all(t in ("answer: yes", "answer: no") for t in texts(outs[1])), texts(outs[1])


def test_free_requests_unchanged_by_constrained_neighbours(llm):
    free = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    greedy = SamplingParams(temperature=0, max_tokens=16)
    alone = [o.outputs[0].token_ids for o in llm.generate(free, greedy)]
    con = sample(max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMAS[0]))
    mixed = llm.generate([free[0], "JSON:", free[1], "JSON:", free[2]], [greedy, con, greedy, con, greedy])
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    for i in (1, 3):
        jsonschema.validate(json.loads(mixed[i].outputs[0].text), SCHEMAS[0])


def test_preempted_constrained_requests_stay_valid():
    """Few KV blocks: requests are preempted and recomputed mid-output; their matchers must not be
    fed the recomputed tokens again (the output would then be refused or invalid)."""
    llm = LLM(dtype="float32", max_model_len=1024, num_kv_blocks=24, block_size=4, max_num_seqs=4, seed=0)
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 40, "maxLength": 60}},
              "required": ["story"], "additionalProperties": False}
    prompts = [f"Tell a very short story about {x} as JSON, in one sentence." for x in ("a cat", "Rome", "rain", "me")]
    outs = llm.generate(prompts, sample(max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema)))
    assert llm.engine.scheduler.num_preemptions > 0
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


def test_logit_bias_offline(llm):
    tok = llm.get_tokenizer()
    prompt = "The capital of France is"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
    banana = tok.encode(" banana", add_special_tokens=False)[0]
    forced = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=4, logit_bias={banana: 100}))
    assert forced[0].outputs[0].token_ids == [banana] * 4
    banned = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logit_bias={base[0]: -100}))
    # the reference: the model's own logits with the bias added, greedy
    from helpers import engine_logits

    logits = engine_logits(llm, tok.encode(prompt)).clone()
    logits[base[0]] -= 100
    assert banned[0].outputs[0].token_ids == [int(logits.argmax())] != base[:1]
    with pytest.raises(InvalidRequestError, match=r"logit_bias token ids must be in \[0, 49152\)"):
        llm.generate(prompt, SamplingParams(logit_bias={10**6: 1}))


def test_invalid_constraint_refused_before_queueing(llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b")))
    assert e.value.param == "structured_outputs.regex" and "unclosed group" in str(e.value)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.structured.matchers
