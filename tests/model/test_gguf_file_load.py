"""A GGUF loaded straight from the file (``GGUFSource``): no float safetensors folder is written, the
tokenizer (special tokens, chat template) comes from its metadata, and the model equals the one
loaded from the same file converted to an HF directory (``convert_gguf_to_hf``: gguf's own
dequantization, held against transformers in test_gguf.py; its direct Q4 route is held against
gguf in tests/quant/test_gguf_direct.py), float and with ``--quantization w4a8``."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from appliance import LLM, SamplingParams
from appliance.errors import ModelLoadError
from appliance.layers.quant import QuantLinear
from appliance.models.gguf_loader import convert_gguf_to_hf

HIDDEN, N_HEAD, N_KV, HEAD_DIM, FFN = 64, 4, 2, 16, 128
KW = {"dtype": "float32", "num_kv_blocks": 32, "max_model_len": 128, "linear_backend": "torch"}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
IDS = list(range(3, 40))
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TYPES = {"blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q4_1", "blk.0.attn_v.weight": "Q4_0",
         "blk.0.attn_output.weight": "Q4_1", "blk.0.ffn_gate.weight": "Q4_0", "blk.0.ffn_up.weight": "Q4_0",
         "blk.0.ffn_down.weight": "Q4_1", "blk.1.attn_q.weight": "Q8_0", "blk.1.attn_k.weight": "Q4_0",
         "blk.1.attn_v.weight": "Q4_0", "blk.1.attn_output.weight": "Q4_0", "blk.1.ffn_gate.weight": "Q4_1",
         "blk.1.ffn_up.weight": "Q4_1", "blk.1.ffn_down.weight": "F16"}


@pytest.fixture(scope="module")
def vocab():
    """The first 1024 tokens of SmolLM2's BPE and the merges among them (as test_gguf_direct.py)."""
    from appliance.models.default_model import default_gguf_path

    reader = gguf.GGUFReader(default_gguf_path())
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()[:1024]
    kept = set(tokens)
    merges = [m for m in reader.fields["tokenizer.ggml.merges"].contents()
              if (pair := m.split(" "))[0] in kept and pair[1] in kept and pair[0] + pair[1] in kept]
    return {"tokens": tokens, "merges": merges,
            "token_type": reader.fields["tokenizer.ggml.token_type"].contents()[:1024]}


def _write_gguf(path: Path, vocab, arch: str = "llama") -> Path:
    rng = np.random.default_rng(0)
    n_vocab = len(vocab["tokens"])

    def rand(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny file-loaded llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["token_type"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    tensors = {"token_embd.weight": rand(n_vocab, HIDDEN), "output_norm.weight": 1 + rand(HIDDEN, scale=0.05),
               "output.weight": rand(n_vocab, HIDDEN)}
    for i in range(2):
        tensors.update({f"blk.{i}.attn_norm.weight": 1 + rand(HIDDEN, scale=0.05),
                        f"blk.{i}.ffn_norm.weight": 1 + rand(HIDDEN, scale=0.05),
                        f"blk.{i}.attn_q.weight": rand(N_HEAD * HEAD_DIM, HIDDEN),
                        f"blk.{i}.attn_k.weight": rand(N_KV * HEAD_DIM, HIDDEN),
                        f"blk.{i}.attn_v.weight": rand(N_KV * HEAD_DIM, HIDDEN),
                        f"blk.{i}.attn_output.weight": rand(HIDDEN, N_HEAD * HEAD_DIM),
                        f"blk.{i}.ffn_gate.weight": rand(FFN, HIDDEN), f"blk.{i}.ffn_up.weight": rand(FFN, HIDDEN),
                        f"blk.{i}.ffn_down.weight": rand(HIDDEN, FFN)})
    for name, t in tensors.items():
        qtype = TYPES.get(name)
        if qtype == "F16":
            w.add_tensor(name, t.astype(np.float16))
        elif qtype is not None:
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(t, q), raw_dtype=q)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def files(vocab, tmp_path_factory):
    """(the GGUF, its converted directory: the reference)."""
    d = tmp_path_factory.mktemp("gguf-file")
    path = _write_gguf(d / "tiny.gguf", vocab)
    return path, convert_gguf_to_hf(path, d / "converted")


def _greedy(llm):
    return [o.outputs[0].token_ids for o in llm.generate([IDS[:9], IDS[5:30]], GREEDY)]


@pytest.mark.parametrize("quantization", ["none", "w4a8"])
def test_gguf_loads_from_the_file_alone(files, tmp_path, monkeypatch, quantization):
    path, converted = files
    cache = tmp_path / "cache"
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(cache))
    before = {p.name for p in path.parent.iterdir()}
    llm = LLM(str(path), quantization=quantization, **KW)
    assert llm.engine.model_path == path
    # nothing written but the tokenizer cache (and the linear backend choices): no weights anywhere
    written = [p.relative_to(cache) for p in cache.rglob("*") if p.is_file()]
    assert written and all(p.parts[0] == "gguf-tokenizer" or str(p) == "linear_backends.json"
                           for p in written), written
    assert not [p for p in written if p.suffix == ".safetensors"]
    assert {p.name for p in path.parent.iterdir()} == before
    model = llm.engine.runner.model
    if quantization == "w4a8":  # layer 1's q/k/v mixes Q8_0 with Q4: that fused layer is quantized from float
        quant = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        assert len(quant) == 8
    ref = LLM(str(converted), quantization=quantization, **KW)
    assert _greedy(llm) == _greedy(ref)
    ids = [IDS[:20]]
    a = llm.generate(ids, SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    b = ref.generate(ids, SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    assert a[0].outputs[0].logprobs == b[0].outputs[0].logprobs


def test_tokenizer_special_tokens_and_chat_template_from_metadata(files, tmp_path, monkeypatch):
    path, _ = files
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path / "cache"))
    tok = LLM(str(path), **KW).engine.tokenizer
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in ["Hello world", "The capital of France is Paris.", "  spaces\tand\nnewlines"]:
        assert tok.encode(text) == ref.encode(text)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.chat_template == TEMPLATE
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # a second engine finds the tokenizer cached (keyed by the file's size and mtime)
    cached = list((tmp_path / "cache" / "gguf-tokenizer").iterdir())
    LLM(str(path), **KW)
    assert list((tmp_path / "cache" / "gguf-tokenizer").iterdir()) == cached


def test_truncated_gguf_names_the_file(files, tmp_path, monkeypatch):
    path, _ = files
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "cut.gguf"
    data = path.read_bytes()
    bad.write_bytes(data[: len(data) - 4096])
    with pytest.raises(ModelLoadError) as e:
        LLM(str(bad), **KW)
    assert str(bad) in str(e.value) and "truncated" in str(e.value)


def test_unsupported_architecture_names_the_file(vocab, tmp_path, monkeypatch):
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path / "cache"))
    path = _write_gguf(tmp_path / "gpt2.gguf", vocab, arch="gpt2")
    with pytest.raises(ModelLoadError) as e:
        LLM(str(path), **KW)
    assert str(path) in str(e.value) and "unsupported GGUF architecture 'gpt2'" in str(e.value)


def test_lean_reader_reads_what_gguf_reads_and_steps_over_the_vocabulary():
    """The appliance's reader (``gguf_loader._open_gguf``: GGUFReader stepping over metadata arrays
    longer than 4096 elements, the vocabulary) gives the same metadata, config and tensor table as
    gguf's own reader on the default model's file (49152 tokens), and refuses to pretend it read a
    skipped array."""
    from appliance.models import gguf_loader
    from appliance.models.default_model import default_gguf_path

    path = default_gguf_path()
    lean, full = gguf_loader._open_gguf(path), gguf.GGUFReader(path)
    assert type(lean) is not gguf.GGUFReader
    meta = gguf_loader._read_metadata(lean, path)
    assert meta == gguf_loader._read_metadata(full, path)
    assert gguf_loader._build_configs(lean, meta, path) == gguf_loader._build_configs(full, meta, path)

    def table(r):
        return [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in r.tensors]

    assert table(lean) == table(full)
    assert set(lean.fields) == set(full.fields)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        assert len(full.fields[key].data) > 4096
        with pytest.raises(ValueError, match=key):
            lean.fields[key].contents()
