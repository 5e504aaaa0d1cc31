"""Units behind the vLLM compatibility: the model's generation defaults (HF generation_config.json
and GGUF general.sampling.* keys) and their merge under request values, the seed range, the
prompt_logprobs shape, unknown-field rules, byte sizes, and the offline LLM's prompt forms."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from appliance import LLM, SamplingParams
from appliance.errors import InvalidRequestError, ModelLoadError
from appliance.generation_defaults import apply_defaults, load_generation_defaults
from appliance.server.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from appliance.errors import ApplianceError
from appliance.vllm_compat import parse_size


# -- generation defaults ---------------------------------------------------------------------------
def test_hf_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05,
         "max_new_tokens": 300, "do_sample": True, "bos_token_id": 1, "eos_token_id": [2, 3]}))
    assert load_generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                                  "repetition_penalty": 1.05, "max_tokens": 300}
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    assert load_generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": "many"}))
    with pytest.raises(ModelLoadError, match="top_k.*'many'"):
        load_generation_defaults(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    assert load_generation_defaults(tmp_path) == {}


def test_gguf_sampling_keys(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_float32("general.sampling.temp", 0.25)
    w.add_uint32("general.sampling.top_k", 40)
    w.add_float32("general.sampling.top_p", 0.5)
    w.add_float32("general.sampling.penalty_repeat", 1.25)
    w.add_uint32("general.sampling.mirostat", 0)  # not a vLLM default: left out
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert load_generation_defaults(path) == {"temperature": 0.25, "top_k": 40, "top_p": 0.5,
                                              "repetition_penalty": 1.25}


def test_apply_defaults_request_wins():
    d = {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 100}
    # unset fields take the model's; set ones keep the request's; max_tokens is capped, as vLLM
    assert apply_defaults({"n": 2, "temperature": None, "top_k": 5, "max_tokens": 500}, d) == \
        {"n": 2, "temperature": 0.6, "top_k": 5, "repetition_penalty": 1.1, "max_tokens": 100}
    assert apply_defaults({"temperature": 0.0, "max_tokens": 7}, d)["temperature"] == 0.0
    assert apply_defaults({"max_tokens": 7}, d)["max_tokens"] == 7
    assert apply_defaults({"max_tokens": None}, d)["max_tokens"] == 100  # "up to the context" -> the cap
    assert apply_defaults({"max_tokens": None}, {}) == {}
    SamplingParams(**apply_defaults({"max_tokens": None}, d))  # a valid SamplingParams


# -- seed range --------------------------------------------------------------------------------------
def test_seed_int64_range():
    SamplingParams(seed=2**63 - 1)
    SamplingParams(seed=-(2**63))
    for bad in (2**63, -(2**63) - 1):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(seed=bad)
        assert e.value.param == "seed" and str(bad) in str(e.value) and str(2**63 - 1) in str(e.value)


# -- prompt_logprobs shape -----------------------------------------------------------------------------
def test_prompt_logprobs_json_ranks():
    from appliance.server.vllm_extras import prompt_logprobs_json

    ids = [5, 7, 9]
    lps = [None,
           {7: -0.5, 3: -1.0, 4: -2.0},  # the prompt token is the top one (k=3 entries: it is among them)
           {1: -0.1, 2: -0.2, 3: -0.3, 9: -4.0}]  # outside the top 3: k + 1 entries, rank unknown
    out = prompt_logprobs_json(lps, ids, k=2, k_engine=3, token_str=lambda t: f"<{t}>")
    assert out[0] is None
    assert out[1] == {"7": {"logprob": -0.5, "rank": 1, "decoded_token": "<7>"},
                      "3": {"logprob": -1.0, "rank": 2, "decoded_token": "<3>"}}
    assert list(out[2]) == ["9", "1", "2"]
    assert out[2]["9"]["rank"] is None and out[2]["2"]["rank"] == 2
    assert prompt_logprobs_json(None, ids, 1, 1, str) is None


# -- unknown request fields ------------------------------------------------------------------------------
def test_unknown_fields(caplog):
    from appliance.server import request_fields

    chat = {"messages": [{"role": "user", "content": "x"}]}
    with caplog.at_level(logging.WARNING, logger="appliance.server"):
        request_fields.check_request_fields(CompletionRequest, {"prompt": "x", "zz_unit_field": 1})
        request_fields.check_request_fields(CompletionRequest, {"prompt": "x", "zz_unit_field": 2})
    assert caplog.text.count("ignoring unknown request field 'zz_unit_field'") == 1
    for cls, data, param in [
        (ChatCompletionRequest, {**chat, "add_special_tokens": True}, "add_special_tokens"),
        (CompletionRequest, {"prompt": "x", "add_special_tokens": False}, "add_special_tokens"),
        (ChatCompletionRequest, {**chat, "tools": [{"type": "function"}], "parallel_tool_calls": False},
         "parallel_tool_calls"),
        (ChatCompletionRequest, {**chat, "functions": [{"name": "f"}]}, "functions"),
        (CompletionRequest, {"prompt": "x", "bad_words": ["a"]}, "bad_words"),
    ]:
        with pytest.raises(OpenAIError) as e:
            request_fields.check_request_fields(cls, data)
        assert e.value.status == 400 and e.value.param == param
    # values that change nothing pass
    request_fields.check_request_fields(ChatCompletionRequest, {**chat, "add_special_tokens": False,
                                                                "parallel_tool_calls": False})
    request_fields.check_request_fields(CompletionRequest, {"prompt": "x", "add_special_tokens": True})
    # a declared field is the model's business, never a rule's (CompletionRequest declares echo)
    request_fields.check_request_fields(CompletionRequest, {"prompt": "x", "echo": True})


# -- byte sizes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [("1024", 1024), ("4G", 4 << 30), ("4g", 4 * 10**9), ("512M", 512 << 20),
                                        ("1.5K", 1536), ("2k", 2000), ("1T", 1 << 40)])
def test_parse_size(text, want):
    assert parse_size("--kv-cache-memory-bytes", text) == want


@pytest.mark.parametrize("text", ["", "G", "4 GB", "-1", "0", "4X"])
def test_parse_size_bad(text):
    with pytest.raises(ApplianceError, match="--kv-cache-memory-bytes"):
        parse_size("--kv-cache-memory-bytes", text)


# -- the offline LLM's prompt forms -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", num_kv_blocks=128, generation_config="vllm")


def texts(outs):
    return [o.outputs[0].text for o in outs]


def test_generate_prompt_forms_match_string_form(llm):
    sp = SamplingParams(temperature=0, max_tokens=6)
    a, b = "The quick brown fox", "Hello world"
    want = texts(llm.generate([a, b], sp))
    ids_a = llm.engine.tokenize(a)
    assert texts(llm.generate({"prompt": a}, sp)) == want[:1]
    assert texts(llm.generate({"prompt_token_ids": ids_a}, sp)) == want[:1]
    assert texts(llm.generate(ids_a, sp)) == want[:1]
    assert texts(llm.generate([{"prompt_token_ids": ids_a}, {"prompt": b}], sp)) == want
    assert texts(llm.generate([ids_a, b], sp)) == want
    assert texts(llm.generate(prompt_token_ids=[ids_a], sampling_params=sp)) == want[:1]


def test_generate_bad_prompt_forms_name_index_and_type(llm):
    for prompts, where, what in [(["ok", 3], "prompts[1]", "int"), (["ok", None], "prompts[1]", "NoneType"),
                                 ([{"text": "x"}], "prompts[0]", "text"), (3.5, "prompts", "float"),
                                 ([{"prompt": "x", "multi_modal_data": {}}], "prompts[0]", "multi_modal_data")]:
        with pytest.raises(InvalidRequestError) as e:
            llm.generate(prompts)
        assert str(e.value).startswith(where + ":") and what in str(e.value), str(e.value)


def test_chat_list_of_conversations(llm):
    sp = SamplingParams(temperature=0, max_tokens=6)
    c1 = [{"role": "user", "content": "Hello"}]
    c2 = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi there"}]
    want = texts(llm.chat(c1, sp)) + texts(llm.chat(c2, sp))
    assert texts(llm.chat([c1, c2], sp)) == want
    assert texts(llm.chat([c1, c2], [sp, sp])) == want
    # chat == generate on the templated prompt
    ids = llm.apply_chat_template(c1)
    assert texts(llm.generate({"prompt_token_ids": ids}, sp)) == want[:1]
    # chat_template_kwargs reach the template (this tiny template ignores unknown ones: same output)
    assert texts(llm.chat(c1, sp, chat_template_kwargs={"enable_thinking": False}, tools=None)) == want[:1]
    for bad, where in [([c1, "x"], "messages[1]"), ([c1, [3]], "messages[1][0]"), ([], "messages")]:
        with pytest.raises(InvalidRequestError) as e:
            llm.chat(bad, sp)
        assert str(e.value).startswith(where + ":"), str(e.value)
