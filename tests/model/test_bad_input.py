"""Bad input: each a clear error naming the argument, the limit and the value; requests already in
the engine are unaffected."""
from __future__ import annotations

import json

import pytest

from appliance import LLM, SamplingParams
from appliance.errors import InvalidRequestError, ModelLoadError


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=128)


@pytest.mark.parametrize("kw,param,words", [
    (dict(max_tokens=0), "max_tokens", ["max_tokens", ">= 1", "0"]),
    (dict(temperature=-0.5), "temperature", ["temperature", ">= 0", "-0.5"]),
    (dict(top_p=0.0), "top_p", ["top_p", "(0, 1]", "0.0"]),
    (dict(top_p=1.5), "top_p", ["top_p", "1.5"]),
    (dict(top_k=-2), "top_k", ["top_k", "-2"]),
    (dict(min_p=2.0), "min_p", ["min_p", "2.0"]),
    (dict(n=0), "n", ["n", "0"]),
    (dict(logprobs=50), "logprobs", ["logprobs", "20", "50"]),
    (dict(stop=[""]), "stop", ["stop"]),
    (dict(min_tokens=9, max_tokens=4), "min_tokens", ["min_tokens", "4", "9"]),
])
def test_bad_sampling_params(kw, param, words):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == param
    for w in words:
        assert w in str(e.value)


def test_bad_prompts_are_rejected_and_others_unaffected(llm):
    eng = llm.engine
    good = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = llm.generate(["The quick brown fox"], good)[0].outputs[0].token_ids
    eng.add_request("good", "The quick brown fox", good)
    eng.step()  # the good request is now mid-flight
    with pytest.raises(InvalidRequestError, match="must not be empty") as e:
        eng.add_request("empty", "", good)
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        eng.add_request("empty-ids", [], good)
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("long", [5] * 200, good)
    assert "200" in str(e.value) and "128" in str(e.value) and e.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("too-many", [5] * 100, SamplingParams(max_tokens=50))
    assert "150" in str(e.value) and "128" in str(e.value) and e.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("vocab", [5, 100000], good)
    assert "100000" in str(e.value) and "384" in str(e.value)
    with pytest.raises(InvalidRequestError, match="already in flight"):
        eng.add_request("good", "again", good)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in outs] == ["good"]
    assert outs[0].outputs[0].token_ids == expected
    eng.check_integrity()


def test_request_bigger_than_whole_cache_is_rejected_at_once(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=4, block_size=16)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["Hello"], SamplingParams(max_tokens=100))
    msg = str(e.value)
    assert "4" in msg and "KV" in msg and "100" in msg
    assert not llm.engine.has_unfinished_requests()


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_unsupported_architecture(tmp_path, llama_dir):
    d = tmp_path / "gpt2"
    d.mkdir()
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        LLM(str(d))
    assert "GPT2LMHeadModel" in str(e.value) and "config.json" in str(e.value)
    assert "LlamaForCausalLM" in str(e.value)  # lists what is supported


def _copy_model(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupt_and_missing_weights(tmp_path, llama_dir):
    d = _copy_model(llama_dir, tmp_path / "corrupt")
    w = d / "model.safetensors"
    w.write_bytes(b"\x00\x01garbage" * 10)
    with pytest.raises(ModelLoadError) as e:
        LLM(str(d))
    assert "model.safetensors" in str(e.value)
    w.unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLM(str(d))
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(d))


def test_shape_mismatch_names_file_and_tensor(tmp_path, llama_dir):
    d = _copy_model(llama_dir, tmp_path / "shape")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        LLM(str(d))
    msg = str(e.value)
    assert "model.safetensors" in msg and "mlp" in msg and "96" in msg


def test_bad_engine_args(llama_dir):
    with pytest.raises(InvalidRequestError, match="max_model_len=4096 exceeds"):
        LLM(str(llama_dir), max_model_len=4096)
    with pytest.raises(InvalidRequestError, match="dtype"):
        LLM(str(llama_dir), dtype="float16x")
    with pytest.raises(InvalidRequestError, match="block_size"):
        LLM(str(llama_dir), block_size=0)
