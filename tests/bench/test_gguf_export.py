"""``appliance.bench.gguf_export`` (HF directory -> GGUF for llama.cpp), held against the appliance's
own GGUF loader: a written GGUF converted back must give the same weights, config and tokenizer."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file
from transformers import AutoTokenizer

from appliance.bench import gguf_export
from appliance.models.gguf_loader import convert_gguf_to_hf

TEXTS = ["The quick brown fox jumps over the lazy dog.", "  Héllo wörld ✓ 東京\n\tdef f(x): return x * 2"]


def _hf_weights(model_dir):
    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("arch,kw", [
    ("llama", {"tie": False, "num_kv_heads": 2}),  # untied lm_head, GQA: q/k rows permuted and back
    ("qwen2", {"tie": True, "num_kv_heads": 2}),  # tied embeddings, q/k/v biases
    ("qwen3", {"tie": False, "num_kv_heads": 1, "head_dim": 32}),  # q/k norms, head_dim != hidden/heads
])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_written_gguf_reads_back_to_the_same_model(tiny_model_dir, tmp_path, arch, kw, dtype):
    src = tiny_model_dir(arch, **kw)
    gguf_path = gguf_export.write_gguf(src, tmp_path / "m.gguf", dtype)
    back = convert_gguf_to_hf(gguf_path, tmp_path / "back")

    want, got = _hf_weights(src), _hf_weights(back)
    if kw["tie"]:
        want.pop("lm_head.weight", None)
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        if dtype == "float16" and w.ndim == 2:  # 2-D weights stored as F16, 1-D ones always F32
            w = w.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(got[name], w, err_msg=name)

    src_cfg, back_cfg = (json.loads((d / "config.json").read_text()) for d in (src, back))
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert back_cfg[key] == src_cfg[key], key
    assert back_cfg["head_dim"] == (src_cfg.get("head_dim") or src_cfg["hidden_size"] // src_cfg["num_attention_heads"])
    assert back_cfg["rope_theta"] == src_cfg.get("rope_theta", src_cfg.get("rope_parameters", {}).get("rope_theta"))

    want_tok, got_tok = AutoTokenizer.from_pretrained(str(src)), AutoTokenizer.from_pretrained(str(back))
    for text in TEXTS:
        assert got_tok(text)["input_ids"] == want_tok(text)["input_ids"], text


def test_gguf_metadata_llama_cpp_reads(tiny_model_dir, tmp_path):
    import gguf

    src = tiny_model_dir("qwen2", tie=True)
    r = gguf.GGUFReader(gguf_export.write_gguf(src, tmp_path / "m.gguf", "bfloat16"))
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.ggml.") or
         k.rsplit(".", 1)[1] not in ("tokens", "token_type", "merges")}
    assert f["general.architecture"] == "qwen2"
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "default"
    assert f["qwen2.block_count"] == 2 and f["qwen2.attention.head_count_kv"] == 2
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    assert len(tokens) == int(emb.shape[1])  # one token per embedding row, as llama.cpp checks
    assert emb.tensor_type == gguf.GGMLQuantizationType.BF16
    assert next(t for t in r.tensors if t.name == "output_norm.weight").tensor_type == gguf.GGMLQuantizationType.F32
    assert "output.weight" not in {t.name for t in r.tensors}  # tied: llama.cpp reuses token_embd


def test_pre_tokenizer_of_the_embedded_vocabulary():
    import gguf

    from appliance.models.default_model import default_gguf_path

    tokens = gguf.GGUFReader(default_gguf_path()).fields["tokenizer.ggml.tokens"].contents()
    # the Qwen2.5-0.5B-shape bench model: SmolLM2's tokenizer, a 151936-row embedding
    assert gguf_export._default_pre(tokens + [f"[PAD{i}]" for i in range(len(tokens), 151936)]) == "smollm"
    assert gguf_export._default_pre(["a", "b"]) == "default"


def test_cached_gguf_is_reused(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path))
    src = tiny_model_dir("llama")
    a = gguf_export.cached_gguf(src)
    mtime = a.stat().st_mtime_ns
    assert gguf_export.cached_gguf(src) == a and a.stat().st_mtime_ns == mtime
    assert gguf_export.cached_gguf(src, "float16") != a
