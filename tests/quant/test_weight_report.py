"""``appliance doctor --model`` and the start-up banner: per layer group (role, stored format, method)
the layer count and resident bytes, from ``appliance.layers.weight_report`` (issue 14).

The model: a tiny llama GGUF in llama.cpp's Q4_K_M mix (``gguf_files.q4_k_m_types``: Q4_K
projections, Q6_K for the tied embedding and for attn_v / ffn_down of layer 1 of 2), loaded with
``--quantization gguf``. The expected stored formats come from the types the test wrote; the
methods from each layer's own ``backend``; the bytes from ``quant.packed_bytes`` of each layer's
packed form and, in total, from ``linear.weight_bytes`` (independent code)."""
from __future__ import annotations

import json

import pytest
import torch
from gguf_files import q4_k_m_types, tokenizer_vocab, write_llama_gguf

from appliance import LLM
from appliance.layers import linear, quant
from appliance.layers.weight_report import WeightGroup, format_groups, total_bytes, weight_groups

LAYERS, HIDDEN, FFN, N_HEAD, N_KV = 2, 256, 512, 4, 2
# GGUF names of each role's shards
_SHARDS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
           "down": ("ffn_down",)}
_MODULES = {"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_up_proj", "down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    types = q4_k_m_types(LAYERS)
    path = write_llama_gguf(tmp_path_factory.mktemp("report") / "q4km.gguf", tokenizer_vocab(), types,
                            layers=LAYERS, hidden=HIDDEN, ffn=FFN, n_head=N_HEAD, n_kv=N_KV)
    llm = LLM(str(path), quantization="gguf", dtype="float32", num_kv_blocks=16, max_model_len=128)
    return llm, types, path


def test_rows_name_the_stored_formats_and_methods(loaded):
    llm, types, _ = loaded
    model = llm.engine.runner.model
    groups = weight_groups(model)
    # every projection of every layer, by the formats its shards were written in
    want: dict[tuple[str, str, str], int] = {}
    for i in range(LAYERS):
        for role, shards in _SHARDS.items():
            stored = "+".join(sorted({types[f"blk.{i}.{s}.weight"] for s in shards}))
            mod = model.get_submodule(f"model.layers.{i}.{_MODULES[role]}")
            assert isinstance(mod, quant.QuantLinear) and mod.backend != "none"
            key = (role, stored, mod.backend)
            want[key] = want.get(key, 0) + 1
    emb, head = model.model.embed_tokens, model.lm_head
    want[("embedding", types["token_embd.weight"], "lookup(lm_head)" if emb.qweight.numel() == 0 else "lookup")] = 1
    want[("lm_head", types["token_embd.weight"], head.backend)] = 1  # tied: the embedding's table
    got = {(g.role, g.stored, g.method): g.layers for g in groups if g.role != "other"}
    assert got == want
    # layer 1's q/k/v mixes Q4_K with a Q6_K v: one row of its own, apart from layer 0's Q4_K-only one
    assert {s for (r, s, _) in got if r == "qkv"} == {"Q4_K", "Q4_K+Q6_K"}
    other = [g for g in groups if g.role == "other"]
    assert [g.stored for g in other] == ["F32"] and other[0].layers == 2 * LAYERS + 1  # the RMSNorms


def test_bytes_are_the_packed_tensors(loaded):
    llm, _, _ = loaded
    model = llm.engine.runner.model
    groups = weight_groups(model)
    for role, modname in _MODULES.items():
        mods = [model.get_submodule(f"model.layers.{i}.{modname}") for i in range(LAYERS)]
        want = sum(quant.packed_bytes(m.packed) + (m.bias.numel() * 4 if m.bias is not None else 0) for m in mods)
        assert sum(g.bytes for g in groups if g.role == role) == want > 0
    assert total_bytes(groups) == linear.weight_bytes(model)
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if n.endswith("norm.weight"))
    assert sum(g.bytes for g in groups if g.role == "other") == norms


def test_table_text():
    text = format_groups([WeightGroup("qkv", "Q4_K", "w4a8_native", 2, 3 << 20),
                          WeightGroup("down", "Q6_K", "w6a8_native", 1, 1 << 19)])
    lines = text.splitlines()
    assert lines[0].split() == ["role", "stored", "method", "layers", "resident"]
    assert lines[1].split() == ["qkv", "Q4_K", "w4a8_native", "2", "3.0", "MiB"]
    assert lines[2].split() == ["down", "Q6_K", "w6a8_native", "1", "0.5", "MiB"]
    assert lines[3].split() == ["total", "3", "3.5", "MiB"]


def test_banner_shows_the_groups(loaded, capsys):
    from appliance.server.engine_core import engine_info
    from appliance.server.launcher import ServerConfig, print_banner

    llm, _, path = loaded
    info = json.loads(json.dumps(engine_info(llm.engine)))  # as it crosses the process pipe
    print_banner(llm.engine.config, ServerConfig(), ["q4km"], info)
    err = capsys.readouterr().err
    groups = weight_groups(llm.engine.runner.model)
    for g in groups:
        assert any(ln.split()[1:4] == [g.role, g.stored, g.method] for ln in err.splitlines() if len(ln.split()) > 4), err
    total = f"{total_bytes(groups) / (1 << 20):.1f}"
    assert any("total" in ln and total in ln for ln in err.splitlines())


def test_doctor_model_reports_the_groups(loaded):
    from appliance.doctor import doctor_report, model_weights, validate

    _, _, path = loaded
    mw = model_weights(str(path), "gguf")
    r = doctor_report()
    r["model_weights"] = mw
    assert validate(r) == []
    roles = {g["role"] for g in mw["groups"]}
    assert {"qkv", "o", "gate_up", "down", "embedding", "lm_head"} <= roles
    assert mw["total_bytes"] == sum(g["bytes"] for g in mw["groups"]) > 0
    assert {g["stored"] for g in mw["groups"] if g["role"] == "down"} == {"Q4_K", "Q6_K"}


def test_float_checkpoint_rows(tiny_model_dir):
    """A float safetensors model: every projection stored F32 on a float method, quantized layers
    (--quantization w8a8) keep the stored format they were quantized from."""
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", quantization="w8a8", num_kv_blocks=16)
    model = llm.engine.runner.model
    groups = weight_groups(model)
    for g in groups:
        assert g.stored == "F32", g
    methods = {g.role: g.method for g in groups}
    assert methods["lm_head"] in linear.FLOAT_BACKENDS  # --quantization leaves lm_head float
    assert all(methods[r] in {m.name for m in quant.methods.of_scheme("w8a8")} for r in _SHARDS)
    assert total_bytes(groups) == linear.weight_bytes(model)
    assert isinstance(model.model.embed_tokens.weight, torch.Tensor)
