"""Bad speculative configs are refused at start, naming the field and the value: unknown keys,
k < 1, an unknown method, bad lookup bounds, a draft with another tokenizer or vocabulary."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from appliance.config import EngineConfig, parse_speculative_config
from appliance.engine.llm_engine import LLMEngine
from appliance.errors import InvalidRequestError, ModelLoadError

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize("cfg, param, words", [
    ({**NGRAM, "num_lookahead_slots": 2}, "speculative_config.num_lookahead_slots", ["num_lookahead_slots"]),
    ({**NGRAM, "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens", [">= 1", "0"]),
    ({**NGRAM, "num_speculative_tokens": -2}, "speculative_config.num_speculative_tokens", ["-2"]),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens", ["required"]),
    ({**NGRAM, "method": "eagle"}, "speculative_config.method", ["'eagle'", "ngram, draft_model"]),
    ({**NGRAM, "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min", ["5", "2"]),
    ({**NGRAM, "prompt_lookup_max": 0}, "speculative_config.prompt_lookup_max", ["0"]),
    ({**NGRAM, "disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size", ["0"]),
    ({**NGRAM, "min_acceptance_rate": 1.5}, "speculative_config.min_acceptance_rate", ["1.5"]),
    ({**NGRAM, "cost_aware": "yes"}, "speculative_config.cost_aware", ["'yes'", "true or false"]),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model", ["required"]),
    ({**NGRAM, "model": "/x"}, "speculative_config.model", ["'/x'", "ngram"]),
    ({"model": "/d", "num_speculative_tokens": 2, "quantization": "int3"}, "speculative_config.quantization",
     ["'int3'", "gguf"]),
    ("{not json", "speculative_config", ["not valid JSON"]),
])
def test_bad_config_refused_before_loading(cfg, param, words):
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(model="/nonexistent", speculative_config=cfg)  # refused before any model is read
    assert e.value.param == param
    for w in words:
        assert w in str(e.value), str(e.value)


def test_vllm_json_accepted():
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                                 '"prompt_lookup_max": 5}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 2, 5)
    c = parse_speculative_config({"model": "/d", "num_speculative_tokens": 2})  # vLLM infers draft_model
    assert (c.method, c.model) == ("draft_model", "/d")


def test_draft_with_other_vocab_size_refused(llama_dir, tiny_model_dir):
    other = tiny_model_dir("llama", vocab_size=400)  # the same tokenizer files, a larger embedding
    with pytest.raises(ModelLoadError, match=r"speculative_config.model=.*vocab_size=400 differs from the target's 384"):
        LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=64, speculative_config={
            "method": "draft_model", "model": str(other), "num_speculative_tokens": 2}))


def test_draft_with_other_tokenizer_refused(llama_dir, tmp_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other-tok"
    shutil.copytree(llama_dir, other)
    tok = AutoTokenizer.from_pretrained(str(other))
    tok.add_tokens(["<extra_token>"])
    tok.save_pretrained(str(other))
    with pytest.raises(ModelLoadError, match=r"speculative_config.model=.*tokenizer differs from the target's"):
        LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=64, speculative_config={
            "method": "draft_model", "model": str(other), "num_speculative_tokens": 2}))


def test_draft_missing_refused(llama_dir, tmp_path):
    with pytest.raises(ModelLoadError, match=r"speculative_config.model='.*nope'"):
        LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=64, speculative_config={
            "method": "draft_model", "model": str(tmp_path / "nope"), "num_speculative_tokens": 2}))


def test_cli_flag_refuses_bad_config(llama_dir):
    r = subprocess.run([sys.executable, "-m", "appliance.cli", "generate", "--model", str(llama_dir), "--prompt", "x",
                        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "speculative_config.num_speculative_tokens must be an integer >= 1, got 0" in r.stderr


def test_cli_generate_with_ngram_matches_plain(llama_dir):
    args = [sys.executable, "-m", "appliance.cli", "generate", "--model", str(llama_dir), "--dtype", "float32",
            "--prompt", "The quick brown fox jumps over the lazy dog. The quick brown fox", "--max-tokens", "16"]
    plain = subprocess.run(args, capture_output=True, text=True, timeout=300)
    spec = subprocess.run(args + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
                          capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout


def test_draft_with_fully_windowed_target_refused(tiny_model_dir):
    path = tiny_model_dir("mistral", sliding_window=12)
    with pytest.raises(ModelLoadError, match=r"speculative_config.model=.*every layer of this target is windowed "
                                             r"\(sliding_window=12\)"):
        LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, speculative_config={
            "method": "draft_model", "model": str(path), "num_speculative_tokens": 2}))
