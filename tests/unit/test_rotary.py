"""RoPE scalings against transformers (modeling_rope_utils' ROPE_INIT_FUNCTIONS, its config classes'
standardization and its rotary modules' cos/sin): inverse frequencies within float32 rounding
(rtol 1e-6), the attention factor to 1e-12, from hub-style configs (old ``rope_scaling`` with
top-level keys) and transformers-5 ones alike."""
from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from appliance.errors import ModelLoadError
from appliance.layers.rotary import build_inv_freq, cos_sin_cache, rope_parameters, rotary_dim
from appliance.models.llama import ARCHS

SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
             intermediate_size=64, vocab_size=64)  # head_dim 32


def factors(n: int, step: float) -> list[float]:
    return [1.0 + step * i for i in range(n)]


# (name, config class, architecture, hub-style config)
CASES = [
    ("phi3-longrope", tf.Phi3Config, "Phi3ForCausalLM", dict(
        max_position_embeddings=8192, original_max_position_embeddings=256, rope_theta=10000.0,
        rope_scaling={"type": "longrope", "short_factor": factors(16, 0.05), "long_factor": factors(16, 0.7)})),
    ("phi3-su-alias", tf.Phi3Config, "Phi3ForCausalLM", dict(
        max_position_embeddings=4096, original_max_position_embeddings=512,
        rope_scaling={"type": "su", "short_factor": factors(16, 0.02), "long_factor": factors(16, 1.1),
                      "original_max_position_embeddings": 512})),  # transformers needs it in the dict for "su"
    ("phi4mini-partial", tf.Phi3Config, "Phi3ForCausalLM", dict(  # rotary over 24 of 32 dims
        max_position_embeddings=131072, original_max_position_embeddings=4096, partial_rotary_factor=0.75,
        rope_theta=10000.0, rope_scaling={"type": "longrope", "short_factor": factors(12, 0.01),
                                          "long_factor": factors(12, 0.9)})),
    ("phi3-explicit-factors", tf.Phi3Config, "Phi3ForCausalLM", dict(
        max_position_embeddings=8192, original_max_position_embeddings=256,
        rope_scaling={"rope_type": "longrope", "short_factor": factors(16, 0.05), "long_factor": factors(16, 0.3),
                      "attention_factor": 1.3})),
    ("qwen2.5-yarn", tf.Qwen2Config, "Qwen2ForCausalLM", dict(
        max_position_embeddings=131072, rope_theta=1000000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})),
    ("yarn-mscale-beta", tf.Qwen2Config, "Qwen2ForCausalLM", dict(
        max_position_embeddings=16384, rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048,
                      "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2})),
    ("yarn-no-truncate", tf.Qwen2Config, "Qwen2ForCausalLM", dict(
        max_position_embeddings=8192, rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096,
                      "truncate": False})),
    ("yarn-attention-factor", tf.LlamaConfig, "LlamaForCausalLM", dict(
        max_position_embeddings=8192, rope_theta=50000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                      "attention_factor": 0.9})),
    ("llama3", tf.LlamaConfig, "LlamaForCausalLM", dict(
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
    ("linear", tf.LlamaConfig, "LlamaForCausalLM", dict(
        max_position_embeddings=4096, rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0})),
    ("default", tf.Qwen2Config, "Qwen2ForCausalLM", dict(max_position_embeddings=4096, rope_theta=1000000.0)),
]


def reference(cls, hub: dict, seq_len: int | None):
    cfg = cls(**SHAPE, **hub)
    rope_type = cfg.rope_parameters["rope_type"]
    if rope_type == "default":
        prf = cfg.rope_parameters.get("partial_rotary_factor", 1.0)
        dim = int(cfg.hidden_size // cfg.num_attention_heads * prf)
        return 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)), 1.0, cfg
    inv, factor = ROPE_INIT_FUNCTIONS[rope_type](cfg, None, seq_len=seq_len)
    return inv, factor, cfg


def ours(arch: str, hub: dict, max_model_len: int):
    hf = {**SHAPE, **hub}
    params = rope_parameters(hf, dict(ARCHS[arch].rope_aliases))
    rd = rotary_dim(SHAPE["hidden_size"] // SHAPE["num_attention_heads"], params)
    return build_inv_freq(rd, params["rope_theta"], params, hf["max_position_embeddings"], max_model_len)


@pytest.mark.parametrize("name,cls,arch,hub", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("regime", ["short", "long"])
def test_inv_freq_and_attention_factor_match_transformers(name, cls, arch, hub, regime):
    """``long``: max_model_len past the original context, which picks longrope's long factors (what
    transformers uses for a sequence longer than the original context); ``short``: within it."""
    original = hub.get("original_max_position_embeddings") or hub.get("rope_scaling", {}).get(
        "original_max_position_embeddings") or hub["max_position_embeddings"]
    max_model_len = original + 1 if regime == "long" else original
    want_inv, want_factor, cfg = reference(cls, hub, seq_len=max_model_len)
    got_inv, got_factor = ours(arch, hub, max_model_len)
    assert got_inv.shape == want_inv.shape
    torch.testing.assert_close(got_inv, want_inv.float(), rtol=1e-6, atol=0)
    assert got_factor == pytest.approx(want_factor, rel=1e-12, abs=1e-12)
    if cfg.rope_parameters["rope_type"] in ("longrope", "yarn"):
        assert got_factor != 1.0 or name == "yarn-no-truncate"  # the factor is exercised


def test_longrope_regimes_differ():
    """The two regimes are not the same numbers (so the tests above tell them apart)."""
    hub = CASES[0][3]
    short, f1 = ours("Phi3ForCausalLM", hub, 256)
    long, f2 = ours("Phi3ForCausalLM", hub, 257)
    assert not torch.allclose(short, long) and f1 == f2


@pytest.mark.parametrize("name", ["phi3-longrope", "phi4mini-partial", "qwen2.5-yarn"])
def test_cos_sin_cache_matches_transformers_rotary_module(name):
    """The cache holds cos and sin times the attention factor, as transformers' rotary module
    returns them (short regime: positions within the original context; long: past it)."""
    _, cls, arch, hub = next(c for c in CASES if c[0] == name)
    cfg = cls(**SHAPE, **hub)
    module = {"Phi3ForCausalLM": tf.models.phi3.modeling_phi3.Phi3RotaryEmbedding,
              "Qwen2ForCausalLM": tf.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding}[arch](cfg)
    original = cfg.rope_parameters["original_max_position_embeddings"]
    for max_model_len in (original, original + 40):
        inv, factor = ours(arch, hub, max_model_len)
        cache = cos_sin_cache(inv, factor, max_model_len)
        positions = torch.arange(max_model_len)[None]  # one forward over the whole length
        cos, sin = module(torch.zeros(1, dtype=torch.float32), positions)
        half = cache.shape[1] // 2
        torch.testing.assert_close(cache[:, :half], cos[0, :, :half], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cache[:, half:], sin[0, :, :half], rtol=1e-5, atol=1e-6)


def test_original_max_position_embeddings_precedence():
    """As transformers: a top-level original_max_position_embeddings wins over the RoPE dict's; without
    either it is max_position_embeddings."""
    hf = dict(max_position_embeddings=1000, original_max_position_embeddings=100,
              rope_scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 300})
    assert rope_parameters(hf)["original_max_position_embeddings"] == 100
    del hf["original_max_position_embeddings"]
    assert rope_parameters(hf)["original_max_position_embeddings"] == 300
    del hf["rope_scaling"]["original_max_position_embeddings"]
    assert rope_parameters(hf)["original_max_position_embeddings"] == 1000
    cfg = tf.Qwen2Config(**SHAPE, **hf)
    assert cfg.rope_parameters["original_max_position_embeddings"] == 1000


@pytest.mark.parametrize("scaling,words", [
    ({"rope_type": "dynamic", "factor": 2.0}, ["rope_type='dynamic'", "not supported", "dynamic NTK"]),
    ({"type": "ntk-by-parts", "factor": 2.0}, ["rope_type='ntk-by-parts'", "supported: default"]),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8}, ["long_factor", "missing"]),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7}, ["long_factor", "7", "8"]),
    ({"rope_type": "llama3", "original_max_position_embeddings": 8}, ["factor", "missing"]),
])
def test_bad_rope_is_refused(scaling, words):
    with pytest.raises(ModelLoadError) as e:
        build_inv_freq(16, 10000.0, scaling, 512, 512)
    for w in words:
        assert w in str(e.value), str(e.value)
