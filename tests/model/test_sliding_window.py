"""Sliding-window attention end to end: tiny random-weight Mistral (every layer windowed) and Qwen2
(use_sliding_window + max_window_layers: mixed layers) against transformers' greedy ``generate`` and
last-token logits in float32 (tokens identical, logits within 1e-4), on prompts several windows
long, through the reference and the native ops (one-call decoder stack on and off), under chunked
prefill, prefix caching and forced preemption; the block pool checked after every step."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from appliance import LLM, SamplingParams
from appliance.config import EngineConfig
from appliance.engine.llm_engine import LLMEngine
from appliance.errors import ModelLoadError
from appliance.layers.attention import layer_sliding_windows
from helpers import engine_logits

WINDOW = 8
MAX_NEW = 20


def prompt_ids():
    rng = random.Random(0)
    # 4x the window, mixed lengths around it, one shorter than the window
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (4 * WINDOW, 4 * WINDOW + 9, 5, 2 * WINDOW + 3, 50)]


@pytest.fixture(scope="module")
def mistral(tiny_model_dir):
    return tiny_model_dir("mistral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def qwen2_mixed(tiny_model_dir):
    # layers 0 and 1 full, 2 and 3 windowed (Qwen2Config: layer i is windowed when i >= max_window_layers)
    return tiny_model_dir("qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
                          num_hidden_layers=4)


@pytest.fixture(scope="module")
def mixtral_windowed(tiny_model_dir):
    return tiny_model_dir("mixtral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def qwen3_moe_mixed(tiny_model_dir):
    return tiny_model_dir("qwen3_moe", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


_HF = {}


def hf_reference(path):
    """transformers' greedy tokens and last-token logits of every prompt (cached per model)."""
    if path not in _HF:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        toks, logits = [], []
        with torch.no_grad():
            for ids in prompt_ids():
                g = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
                toks.append(g[0, len(ids):].tolist())
                logits.append(hf(torch.tensor([ids])).logits[0, -1].float())
        _HF[path] = toks, logits
    return _HF[path]


def run_engine(engine: LLMEngine, ids, params, repeat_first=False):
    """Drive the engine step by step, checking the block pool after each; returns each request's tokens."""
    for i, p in enumerate(ids):
        engine.add_request(str(i), p, params)
    done, step = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.check_integrity()
        step += 1
        assert step < 2000
        if repeat_first and step == 1:  # the same prompt again while the first is still running
            engine.add_request("again", ids[0], params)
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks  # everything returned
    return [done[str(i)] for i in range(len(ids))], done.get("again")


def test_layer_windows_follow_transformers_configs():
    """The per-layer windows equal what transformers' own config classes decide (layer_types and
    sliding_window after their __post_init__), from the raw dicts a checkpoint carries."""
    cases = [
        (transformers.MistralConfig, dict(sliding_window=8), [8, 8, 8]),
        (transformers.MistralConfig, dict(sliding_window=None), [None] * 3),
        (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), [None, 8, 8]),
        (transformers.Qwen2Config, dict(use_sliding_window=False, sliding_window=8, max_window_layers=1), [None] * 3),
        (transformers.Qwen3Config, dict(use_sliding_window=True, sliding_window=6, max_window_layers=2), [None, None, 6]),
        (transformers.Qwen2MoeConfig, dict(use_sliding_window=True, sliding_window=6, max_window_layers=3), [6, None, 6]),
        (transformers.Qwen3MoeConfig, dict(use_sliding_window=True, sliding_window=6, max_window_layers=1), [6, 6, 6]),
        (transformers.Qwen3MoeConfig, dict(use_sliding_window=False, sliding_window=6), [None] * 3),
        (transformers.MixtralConfig, dict(sliding_window=5), [5, 5, 5]),
    ]
    for cls, kw, want in cases:
        cfg = cls(num_hidden_layers=3, **kw)
        windows = [cfg.sliding_window if t == "sliding_attention" else None
                   for t in getattr(cfg, "layer_types", None) or ["sliding_attention"] * 3]
        assert windows == want, (cls.__name__, kw)
        saved = cfg.to_dict()  # what save_pretrained writes (transformers 5 adds layer_types)
        assert layer_sliding_windows(saved, 3) == want, (cls.__name__, kw, saved.get("layer_types"))
        raw = {"model_type": cfg.model_type, **kw}  # an older config.json: no layer_types
        assert layer_sliding_windows(raw, 3) == want, (cls.__name__, kw)
    # Gemma-style interleaving through layer_types
    gemma = {"model_type": "gemma2", "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
    assert layer_sliding_windows(gemma, 2) == [4, None]


@pytest.mark.parametrize("cfg,msg", [
    ({"sliding_window": 0}, "sliding_window must be a positive integer or null, got 0"),
    ({"sliding_window": 8, "layer_types": ["sliding_attention"]}, "layer_types has 1 entries; the model has "
                                                                  "num_hidden_layers=2"),
    ({"sliding_window": 8, "layer_types": ["chunked_attention", "full_attention"]},
     "layer_types ['chunked_attention'] not supported"),
])
def test_bad_window_configs_are_refused(cfg, msg):
    with pytest.raises(ModelLoadError) as e:
        layer_sliding_windows(cfg, 2)
    assert msg in str(e.value)


def test_model_layers_get_their_windows(mistral, qwen2_mixed):
    for path, want in ((mistral, [WINDOW, WINDOW]), (qwen2_mixed, [0, 0, WINDOW, WINDOW])):
        llm = LLM(str(path), dtype="float32", attention_backend="reference", num_kv_blocks=64)
        assert [layer.self_attn.attn.sliding_window for layer in llm.engine.runner.model.model.layers] == want


@pytest.mark.parametrize("model", ["mistral", "qwen2_mixed"])
@pytest.mark.parametrize("backend,fused", [("reference", False), ("native", True), ("native", False)])
def test_greedy_and_logits_match_transformers(request, model, backend, fused, monkeypatch):
    from appliance.ops import native

    path = request.getfixturevalue(model)
    if backend == "native":
        assert native.is_available(), native.unavailable_reason()
        monkeypatch.setattr(native, "FUSED_LAYERS", fused)
    calls = []
    real = native.llama_layers
    monkeypatch.setattr(native, "llama_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    llm = LLM(str(path), dtype="float32", attention_backend=backend, block_size=4, num_kv_blocks=256,
              linear_backend="native" if backend == "native" else "auto")
    ids = prompt_ids()
    outs = llm.generate(prompt_token_ids=ids,
                        sampling_params=SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert bool(calls) == fused  # the one-call stack ran exactly when it was meant to
    toks, logits = hf_reference(path)
    assert [o.outputs[0].token_ids for o in outs] == toks
    for p, want in zip(ids, logits):
        torch.testing.assert_close(engine_logits(llm, p), want, atol=1e-4, rtol=0)
    llm.engine.check_integrity()
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("model", ["mixtral_windowed", "qwen3_moe_mixed"])
@pytest.mark.parametrize("backend", ["reference", "native"])
def test_moe_models_with_windows_match_transformers(request, model, backend):
    """The MoE families share llama.py's attention, so their windows go through the same kernels."""
    path = request.getfixturevalue(model)
    llm = LLM(str(path), dtype="float32", attention_backend=backend, block_size=4, num_kv_blocks=256)
    layers = llm.engine.runner.model.model.layers
    want_windows = [WINDOW, WINDOW]  # Qwen3-MoE windows every layer, whatever max_window_layers says
    assert [layer.self_attn.attn.sliding_window for layer in layers] == want_windows
    ids = prompt_ids()
    outs = llm.generate(prompt_token_ids=ids,
                        sampling_params=SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    toks, logits = hf_reference(path)
    assert [o.outputs[0].token_ids for o in outs] == toks
    for p, want in zip(ids, logits):
        torch.testing.assert_close(engine_logits(llm, p), want, atol=1e-4, rtol=0)
    llm.engine.check_integrity()


SCHEDULES = {
    "chunked_prefill": dict(max_num_batched_tokens=6),
    "long_prefill_threshold": dict(long_prefill_token_threshold=5, max_num_batched_tokens=40),
    # 18 blocks of 4 hold the longest request alone; 15 requests admitted a chunk of 4 at a time
    # outgrow them within a step or two, even with blocks out of the window going back
    "preemption": dict(num_kv_blocks=18, long_prefill_token_threshold=4),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("backend", ["reference", "native"])
def test_same_tokens_under_any_schedule(mistral, name, backend):
    cfg = dict(model=str(mistral), dtype="float32", attention_backend=backend, block_size=4, num_kv_blocks=256)
    cfg.update(SCHEDULES[name])
    engine = LLMEngine(EngineConfig(**cfg))
    copies = 3 if name == "preemption" else 1
    got, _ = run_engine(engine, prompt_ids() * copies,
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert got == hf_reference(mistral)[0] * copies
    if name == "preemption":
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_prefix_cache_hit_on_a_windowed_model(mistral, backend):
    """The same prompt twice (the second while the first runs, then once more after): prefix-cache
    hits, and transformers' tokens every time."""
    engine = LLMEngine(EngineConfig(model=str(mistral), dtype="float32", attention_backend=backend,
                                    block_size=4, num_kv_blocks=256))
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    ids = prompt_ids()
    want = hf_reference(mistral)[0]
    got, again = run_engine(engine, ids, params, repeat_first=True)
    assert got == want and again == want[0]
    hits = engine.kv.pool.num_hits
    assert hits > 0
    got, _ = run_engine(engine, ids[:1], params)
    assert got == want[:1] and engine.kv.pool.num_hits > hits


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_windowed_model_holds_a_bounded_number_of_blocks(mistral, backend):
    """Every layer windowed: blocks before the window go back to the pool as the request advances,
    so a request several windows long holds at most window / block_size + 2 blocks at any step,
    and still gives transformers' tokens."""
    from appliance.engine.block_pool import NULL_BLOCK

    block_size = 4
    engine = LLMEngine(EngineConfig(model=str(mistral), dtype="float32", attention_backend=backend,
                                    block_size=block_size, num_kv_blocks=64, max_num_batched_tokens=4))
    assert engine.kv.sliding_window == WINDOW
    ids = prompt_ids()[1]  # 41 tokens, prefilled 4 at a time, then 20 decoded
    engine.add_request("0", ids, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    req = engine.scheduler.requests["0"]
    held, released, out = [], 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        engine.check_integrity()
        if not req.is_finished:
            held.append(sum(b != NULL_BLOCK for b in req.block_ids))
            released = max(released, sum(b == NULL_BLOCK for b in req.block_ids))
    assert out.outputs[0].token_ids == hf_reference(mistral)[0][1]
    assert max(held) <= WINDOW // block_size + 2, held
    assert released >= (len(ids) + MAX_NEW - WINDOW) // block_size - 1  # most of it went back
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks


def test_mixed_layers_release_nothing(qwen2_mixed):
    """A full-attention layer reads the whole context: no block may be released."""
    engine = LLMEngine(EngineConfig(model=str(qwen2_mixed), dtype="float32", attention_backend="reference",
                                    block_size=4, num_kv_blocks=64))
    assert engine.kv.sliding_window is None


def _held(req):
    from appliance.engine.block_pool import NULL_BLOCK
    return sum(b != NULL_BLOCK for b in req.block_ids)


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_windowed_request_longer_than_the_pool_is_admitted(mistral, qwen2_mixed, backend):
    """Admission counts the blocks a request holds at once: with every layer windowed that is the
    window plus one step's chunk, so a 61-token request (16 blocks of 4) runs in a 6-block pool and
    gives transformers' tokens; a model with a full-attention layer still needs all 16 and is refused
    with the count in the message."""
    cfg = dict(dtype="float32", attention_backend=backend, block_size=4, num_kv_blocks=6,
               max_num_batched_tokens=4)
    engine = LLMEngine(EngineConfig(model=str(mistral), **cfg))
    ids = prompt_ids()[1]
    assert engine.kv.max_blocks_held(len(ids) + MAX_NEW, 4) == 4 < engine.kv.num_blocks
    got, _ = run_engine(engine, [ids], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert got == [hf_reference(mistral)[0][1]]
    mixed = LLMEngine(EngineConfig(model=str(qwen2_mixed), **cfg))
    with pytest.raises(Exception, match=r"needs 16 KV blocks of 4 tokens at once; the whole KV cache has 6"):
        mixed.add_request("x", ids, SamplingParams(temperature=0, max_tokens=MAX_NEW))


def test_prefix_hit_before_the_window_holds_no_blocks(mistral):
    """A cached prefix longer than the window: the hit blocks before the window are not taken (NULL in
    the table), so the second run holds no more blocks than the bound, hits the cache, and gives the
    same tokens."""
    engine = LLMEngine(EngineConfig(model=str(mistral), dtype="float32", attention_backend="reference",
                                    block_size=4, num_kv_blocks=64, max_num_batched_tokens=4))
    ids = prompt_ids()[1]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    want = [hf_reference(mistral)[0][1]]
    assert run_engine(engine, [ids], params)[0] == want
    hits = engine.kv.pool.num_hits
    engine.add_request("again", ids, params)
    req = engine.scheduler.requests["again"]
    held, out = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        engine.check_integrity()
        if not req.is_finished:
            held.append(_held(req))
    assert engine.kv.pool.num_hits - hits == (len(ids) - 1) // 4 * 4  # every full prompt block hit
    assert max(held) <= WINDOW // 4 + 2, held
    assert out.outputs[0].token_ids == want[0]
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks
