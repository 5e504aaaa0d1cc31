"""Phi-3 (fused qkv_proj / gate_up_proj checkpoints, longrope, Phi-4-mini's partial rotary) and Qwen2
with yarn, against transformers in float32: greedy tokens of ``generate`` on mixed-length prompts and
last-token logits within 1e-4, on the reference and the native ops, under chunked prefill and prefix
caching too; Phi-3's sliding window.

Longrope: the engine picks the short or long factors once from max_model_len (see
appliance/layers/rotary.py); transformers picks them per forward from the sequence length. They agree
when every sequence stays on one side of original_max_position_embeddings (64 here), so each regime
is tested where it holds: prompts longer than 64 tokens with max_model_len 512 (long factors), and
whole sequences within 64 tokens with max_model_len 64 (short factors)."""
from __future__ import annotations

import pytest

from appliance import LLM, SamplingParams
from appliance.config import EngineConfig
from appliance.engine.llm_engine import LLMEngine
from helpers import check_against_transformers, engine_logits, hf_greedy, stack_at_every_step_size
from test_engine_invariance import run_engine

ORIGINAL = 64  # original_max_position_embeddings of the tiny models; max_position_embeddings is 512


def longrope(rot_dim: int) -> dict:
    n = rot_dim // 2
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(n)],
            "long_factor": [1.0 + 0.9 * i for i in range(n)]}


MODELS = {
    # head_dim 16: rotary over all 16 dims
    "phi3": ("phi3", dict(rope_scaling=longrope(16), original_max_position_embeddings=ORIGINAL)),
    # Phi-4-mini: rotary over 12 of 16 dims, tied embeddings
    "phi3-partial": ("phi3", dict(rope_scaling=longrope(12), original_max_position_embeddings=ORIGINAL,
                                  partial_rotary_factor=0.75, tie=True)),
    # Phi-3-mini-4k: every layer windowed (its config has sliding_window 2047), here 8 tokens
    "phi3-window": ("phi3", dict(sliding_window=8)),
    # Qwen2.5 long context: factor 4 over an original 64-token context
    "qwen2-yarn": ("qwen2", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": ORIGINAL})),
}
TEXT = ("Paris is the capital of France. The quick brown fox jumps over the lazy dog. Hello world! "
        "Héllo wörld, ünïcode ✓ 東京 def f(x): return x * 2 ")
MAX_NEW = 24


def model_dir(tiny_model_dir, name):
    arch, kw = MODELS[name]
    kw = dict(kw)
    tie = kw.pop("tie", False)
    return tiny_model_dir(arch, tie, 2, **kw)


def prompt_ids(tok, regime: str) -> list[list[int]]:
    ids = tok.encode(TEXT * 4)
    if regime == "long":  # every prompt past the original context
        lengths = [ORIGINAL + 1, ORIGINAL + 30, 150, 97]
    else:  # every whole sequence (prompt + MAX_NEW) within it
        lengths = [5, ORIGINAL - MAX_NEW, 17, 31]
    assert len(ids) >= max(lengths)
    return [ids[i:i + n] for i, n in enumerate(lengths)]  # different starts: different texts


@pytest.mark.parametrize("name,regime", [("phi3", "long"), ("phi3", "short"), ("phi3-partial", "long"),
                                         ("phi3-partial", "short"), ("qwen2-yarn", "long"), ("qwen2-yarn", "short")])
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_greedy_and_logits_match_transformers(tiny_model_dir, name, regime, backend):
    path = model_dir(tiny_model_dir, name)
    max_model_len = 512 if regime == "long" else ORIGINAL
    llm = LLM(str(path), dtype="float32", attention_backend=backend, num_kv_blocks=128, max_model_len=max_model_len)
    assert llm.engine.max_model_len == max_model_len
    # the cache the model built covers max_model_len positions and carries the attention factor
    cache = llm.engine.runner.model.rotary.cos_sin_cache
    assert cache.shape[0] == max_model_len and cache.abs().max() > 1.0
    check_against_transformers(llm, path, prompt_ids(llm.get_tokenizer(), regime), MAX_NEW)


def test_longrope_regime_is_chosen_from_max_model_len(tiny_model_dir):
    """The same short prompt gets different logits with max_model_len past the original context (long
    factors) and within it (short factors); only the latter is what transformers computes for it."""
    path = model_dir(tiny_model_dir, "phi3")
    short = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=ORIGINAL)
    long = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=ORIGINAL + 1)
    ids = prompt_ids(short.get_tokenizer(), "short")[1]
    a, b = engine_logits(short, ids), engine_logits(long, ids)
    assert (a - b).abs().max() > 1e-2


def test_fused_native_stack_takes_partial_rotary(tiny_model_dir, monkeypatch):
    """Native linears and attention: the one-call decoder stack runs Phi-4-mini's shape (partial
    rotary, tied embeddings) and gives transformers' tokens and logits."""
    stack_at_every_step_size(monkeypatch)
    from appliance.ops import native

    assert native.is_available(), native.unavailable_reason()
    calls = []
    real = native.llama_layers
    monkeypatch.setattr(native, "llama_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    path = model_dir(tiny_model_dir, "phi3-partial")
    llm = LLM(str(path), dtype="float32", linear_backend="native", attention_backend="native", num_kv_blocks=128)
    check_against_transformers(llm, path, prompt_ids(llm.get_tokenizer(), "long"), MAX_NEW)
    assert len(calls) >= MAX_NEW


@pytest.mark.parametrize("backend,fused", [("reference", False), ("native", True), ("native", False)])
def test_sliding_window_matches_transformers(tiny_model_dir, backend, fused, monkeypatch):
    """Phi-3's sliding_window reaches every layer's attention (through layer_sliding_windows): prompts
    of up to ~19 windows give transformers' tokens and logits, the one-call native stack on and off."""
    from appliance.ops import native

    if backend == "native":
        assert native.is_available(), native.unavailable_reason()
        monkeypatch.setattr(native, "FUSED_LAYERS", fused)
    calls = []
    real = native.llama_layers
    monkeypatch.setattr(native, "llama_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    path = model_dir(tiny_model_dir, "phi3-window")
    llm = LLM(str(path), dtype="float32", attention_backend=backend, block_size=4, num_kv_blocks=256,
              linear_backend="native" if backend == "native" else "auto")
    assert [layer.self_attn.attn.sliding_window for layer in llm.engine.runner.model.model.layers] == [8, 8]
    check_against_transformers(llm, path, prompt_ids(llm.get_tokenizer(), "long"), MAX_NEW)
    assert bool(calls) == fused


@pytest.mark.parametrize("name", ["phi3-partial", "phi3-window", "qwen2-yarn"])
@pytest.mark.parametrize("cfg", [dict(max_num_batched_tokens=8), dict(enable_prefix_caching=True, block_size=4)],
                         ids=["chunked_prefill", "prefix_caching"])
def test_chunked_prefill_and_prefix_caching_give_transformers_tokens(tiny_model_dir, name, cfg):
    path = model_dir(tiny_model_dir, name)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=256, **cfg))
    ids = prompt_ids(engine.tokenizer, "long")
    # shared prefixes: the later prompts start with an earlier one, so cached blocks are hit
    ids = ids + [ids[0] + ids[3][:9], ids[2][:80] + ids[1][:5]]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    got = run_engine(engine, ids, params, stagger=2)
    _, ref = hf_greedy(path, ids, MAX_NEW)
    assert got == ref


@pytest.mark.parametrize("name", ["phi3-partial", "qwen2-yarn"])
def test_forced_preemption_gives_transformers_tokens(tiny_model_dir, name):
    # 48 blocks of 4 hold the longest request (150 + 24 tokens) alone but not six at once: requests are
    # preempted and recomputed, and the rotary cache (long factors, partial or yarn) must give the
    # same keys the second time
    path = model_dir(tiny_model_dir, name)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=48, block_size=4,
                                    max_num_batched_tokens=64))
    ids = prompt_ids(engine.tokenizer, "long")
    ids = ids + [ids[0] + ids[3][:9], ids[2][:80] + ids[1][:5]]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    got = run_engine(engine, ids, params)
    assert engine.scheduler.num_preemptions > 0
    _, ref = hf_greedy(path, ids, MAX_NEW)
    assert got == ref


@pytest.mark.parametrize("name,regime", [("phi3", "long"), ("phi3-partial", "short"), ("phi3-partial", "long"),
                                         ("phi3-window", "long")])
def test_gguf_round_trip(tiny_model_dir, tmp_path, name, regime):
    """Phi-3 written as llama.cpp's converter writes it (attn_qkv and ffn_up = [gate; up] fused as in the
    checkpoint, the rotated dims, longrope as rope_factors_long/short tensors with the original context
    and attention factor, the window) loads as Phi3ForCausalLM and gives transformers' tokens and logits
    in both longrope regimes."""
    from gguf import GGUFReader

    from appliance.bench.gguf_export import write_gguf

    path = model_dir(tiny_model_dir, name)
    gguf_path = write_gguf(path, tmp_path / f"{name}.gguf")
    names = {t.name for t in GGUFReader(gguf_path).tensors}
    assert {"blk.0.attn_qkv.weight", "blk.0.ffn_up.weight"} <= names and "blk.0.ffn_gate.weight" not in names
    assert ("rope_factors_long.weight" in names) == (name != "phi3-window")
    max_model_len = 512 if regime == "long" else ORIGINAL
    llm = LLM(str(gguf_path), dtype="float32", num_kv_blocks=128, max_model_len=max_model_len)
    assert llm.engine.info.architecture == "Phi3ForCausalLM"
    check_against_transformers(llm, path, prompt_ids(llm.get_tokenizer(), regime), MAX_NEW)


def test_q8_0_gguf_keeps_the_fused_blocks(tiny_model_dir, tmp_path):
    """A Q8_0 Phi-3 file with ``--quantization gguf``: the fused attn_qkv and ffn_up tensors are kept as
    the file's 8-bit blocks (W8 groups of 32, nothing re-quantized), and the logits stay within W8A8's
    activation rounding of the same file's float route."""
    from appliance.bench.gguf_export import write_gguf
    from appliance.layers.quant import QuantLinear
    from helpers import engine_logits

    path = model_dir(tiny_model_dir, "phi3")
    gguf_path = write_gguf(path, tmp_path / "phi3-q8_0.gguf", dtype="q8_0")
    quant = LLM(str(gguf_path), dtype="float32", num_kv_blocks=64, quantization="gguf")
    kept = {n: (m.scheme, m.group_size) for n, m in quant.engine.runner.model.named_modules()
            if isinstance(m, QuantLinear)}
    assert kept["model.layers.0.self_attn.qkv_proj"] == ("w8a8", 32)
    assert kept["model.layers.1.mlp.gate_up_proj"] == ("w8a8", 32)
    assert len(kept) == 9  # 4 projections x 2 layers and the lm_head
    flt = LLM(str(gguf_path), dtype="float32", num_kv_blocks=64)
    for ids in prompt_ids(flt.get_tokenizer(), "short"):
        want, got = engine_logits(flt, ids), engine_logits(quant, ids)
        assert (got - want).abs().max() <= 0.05 * want.abs().max(), ids
