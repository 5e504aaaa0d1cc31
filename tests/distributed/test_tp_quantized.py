"""Quantized models at TP=2 against TP=1: a GGUF kept quantized (Q8_0 projections and a Q8_0
embedding tied to the lm_head: a vocabulary-parallel ``QuantEmbedding`` and quantized head) and a
float checkpoint quantized to W8A8 at load. Column-parallel layers hold exactly TP=1's rows; the
row-parallel ones quantize activations per token over each rank's slice of the input (and, for W8A8
quantized at load, take per-channel scales of their slice), so TP=2 is not TP=1 to 1e-4. What is
checked: TP=2 is as close to the float model (the same weights dequantized, float activations) as
TP=1 is, within 1.5x, and within 5% of TP=1 (a wrong slice or a missed all-reduce is 100%).

A GGUF in llama.cpp's Q4_K_M mix keeps its K-quant scales on every rank: each rank reports
(``TPExecutor.rank_stats``) the layers it holds as K-quant packs, every quantized one, the
row-parallel o_proj whose 128 inputs a rank cut a super-block of 256 included (held at 128)."""
from __future__ import annotations

import pytest
import torch
from gguf_files import q4_k_m_types, tokenizer_vocab, write_llama_gguf
from helpers import engine_logits

from appliance import LLM
from appliance.layers.quant import QuantLinear
from appliance.layers.vocab import QuantEmbedding

KW = dict(dtype="float32", num_kv_blocks=32, max_model_len=128)
IDS = list(range(3, 40))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _assert_close_as_tp1(what, got, want, flt):
    tp, q1, q2 = _rel(got, want), _rel(want, flt), _rel(got, flt)
    print(f"{what}: logits relative to float: TP=1 {q1:.2e}, TP=2 {q2:.2e}; TP=2 vs TP=1 {tp:.2e}")
    assert q1 > 1e-3  # quantized for real
    assert q2 <= 1.5 * q1 and tp < 0.05, (q1, q2, tp)


def _pair(path, **kw):
    """(the TP=2 LLM, its logits, TP=1's, the float model's)."""
    ref = LLM(str(path), **KW)
    flt = engine_logits(ref, IDS)
    del ref
    one = LLM(str(path), **KW, **kw)
    want = engine_logits(one, IDS)
    del one
    two = LLM(str(path), tensor_parallel_size=2, **KW, **kw)
    try:
        return two, engine_logits(two, IDS), want, flt
    finally:
        two.engine.runner.close()


def test_gguf_q8_0_with_a_tied_quantized_vocabulary(tmp_path):
    layers = 2
    types = {"token_embd.weight": "Q8_0"}
    for i in range(layers):
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            types[f"blk.{i}.{t}.weight"] = "Q8_0"
    vocab = tokenizer_vocab()
    path = write_llama_gguf(tmp_path / "q8.gguf", vocab, types, layers=layers, hidden=128, ffn=256, n_head=4, n_kv=2)
    two, got, want, flt = _pair(path, quantization="gguf")
    model = two.engine.runner.model
    emb = model.model.embed_tokens
    assert isinstance(emb, QuantEmbedding) and emb.tp_mode == "vocab"
    assert emb.num_embeddings == len(vocab["tokens"]) // 2 and isinstance(model.lm_head, QuantLinear)
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, QuantLinear) and down.tp_mode == "row" and down.in_features == 128
    _assert_close_as_tp1("GGUF Q8_0", got, want, flt)


def test_w8a8_quantized_at_load(llama_dir):
    two, got, want, flt = _pair(llama_dir, quantization="w8a8")
    qkv = two.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.tp_mode == "column" and qkv.out_features == (64 + 2 * 32) // 2
    _assert_close_as_tp1("W8A8", got, want, flt)


def _kquant_layers(model) -> list[str]:
    return sorted(n for n, m in model.named_modules()
                  if isinstance(getattr(m, "packed", None), dict) and "kf" in m.packed)


def test_gguf_q4_k_m_keeps_its_k_quant_scales_on_every_rank(tmp_path):
    """Q4_K projections, Q6_K attn_v / ffn_down of layer 1 and the tied Q6_K embedding (hidden 256,
    ffn 512): column-parallel q/k/v and gate/up, the row-parallel o_proj (128 inputs a rank) and
    down_proj (256) and the vocabulary-parallel lm_head keep the file's scales on both ranks. Logits
    as TP=1's within the quantized TP tolerance."""
    layers = 2
    path = write_llama_gguf(tmp_path / "q4km.gguf", tokenizer_vocab(), q4_k_m_types(layers), layers=layers,
                            hidden=256, ffn=512, n_head=4, n_kv=2)
    ref = LLM(str(path), **KW)
    flt = engine_logits(ref, IDS)
    del ref
    one = LLM(str(path), quantization="gguf", **KW)
    want = engine_logits(one, IDS)
    tp1_kq = _kquant_layers(one.engine.runner.model)
    del one
    every = sorted([f"model.layers.{i}.{m}" for i in range(layers)
                    for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
                   + ["lm_head"])
    assert tp1_kq == every
    two = LLM(str(path), quantization="gguf", tensor_parallel_size=2, **KW)
    try:
        got = engine_logits(two, IDS)
        stats = two.engine.runner.rank_stats()
        supers = {n: m.packed["super"] for n, m in two.engine.runner.model.named_modules()
                  if n.endswith("_proj") and isinstance(m, QuantLinear)}
    finally:
        two.engine.runner.close()
    assert len(stats) == 2
    for s in stats:  # rank 0 (this process) and rank 1 (a spawned worker), each from its own model
        assert s["kquant_layers"] == every, s
    assert {n: v for n, v in supers.items() if v != 256} == {f"model.layers.{i}.self_attn.o_proj": 128
                                                              for i in range(layers)}
    _assert_close_as_tp1("GGUF Q4_K_M", got, want, flt)
