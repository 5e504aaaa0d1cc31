"""A config with a feature the engine does not implement is refused at load with a ModelLoadError
naming the field and its value (never served with the feature ignored)."""
from __future__ import annotations

import json
import shutil

import pytest

from appliance import LLM
from appliance.errors import ModelLoadError


def with_config(tmp_path, src, **changes):
    d = tmp_path / "m"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d


REFUSED = {
    "dynamic_ntk": (dict(rope_parameters=None, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                    ["rope_type='dynamic'", "dynamic NTK"]),
    "unknown_rope": (dict(rope_parameters={"rope_type": "mrope", "rope_theta": 10000.0}),
                     ["rope_type='mrope'", "supported: default, linear, llama3, longrope, yarn"]),
    "old_type_key": (dict(rope_parameters=None, rope_scaling={"type": "ntk", "factor": 2.0}), ["rope_type='ntk'"]),
    "longrope_length": (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                              "short_factor": [1.0] * 8, "long_factor": [1.0] * 5}),
                        ["rope_scaling.long_factor", "5", "8"]),
    "partial_rotary": (dict(partial_rotary_factor=0.5), ["partial_rotary_factor=0.5"]),
    "hidden_act": (dict(hidden_act="gelu"), ["hidden_act='gelu'", "silu"]),
    "hidden_activation": (dict(hidden_activation="gelu_pytorch_tanh"), ["hidden_activation='gelu_pytorch_tanh'"]),
    "vision_config": (dict(vision_config={"model_type": "siglip_vision_model"}), ["vision_config", "text only"]),
    "audio_config": (dict(audio_config={"model_type": "whisper"}), ["audio_config"]),
    "sinks_flag": (dict(use_attention_sinks=True), ["use_attention_sinks=True", "attention sinks"]),
    "sinks_init": (dict(learnable_sink_init=0.0), ["learnable_sink_init=0.0", "attention sinks"]),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_feature_is_refused_at_load(tmp_path, llama_dir, name):
    changes, words = REFUSED[name]
    d = with_config(tmp_path, llama_dir, **changes)
    with pytest.raises(ModelLoadError) as e:
        LLM(str(d), dtype="float32", num_kv_blocks=16)
    msg = str(e.value)
    assert "config.json" in msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("changes", [dict(use_attention_sinks=False, hidden_act="swish", sinkhorn_iters=20,
                                          vision_config=None)])
def test_harmless_values_load(tmp_path, llama_dir, changes):
    """A sink flag set to false, silu's other name, a key that only contains "sink": accepted."""
    LLM(str(with_config(tmp_path, llama_dir, **changes)), dtype="float32", num_kv_blocks=16)


def test_phi3_partial_rotary_accepted_but_not_for_llama(tmp_path, tiny_model_dir):
    """partial_rotary_factor is per architecture: Phi-3 implements it (tests/model/test_phi3.py)."""
    d = with_config(tmp_path, tiny_model_dir("phi3"), partial_rotary_factor=0.5,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    LLM(str(d), dtype="float32", num_kv_blocks=16)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="partial_rotary_factor=0.5"):
        LLM(str(d), dtype="float32", num_kv_blocks=16)
