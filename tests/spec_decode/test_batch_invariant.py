"""--batch-invariant (vLLM's VLLM_BATCH_INVARIANT): a request's logits are the same bits however the
engine schedules it, with the linear methods auto picks, not pinned by the test. test_schedule_bits.py
pins the native methods and raises the native float GEMM's row limit by hand to show the kernels can be
row-invariant; here the engine does both itself: only row-invariant methods are candidates, and the
native float GEMM stays on its panel kernel at prefill sizes (by default a step of more than
NATIVE_F32_MAX_ROWS tokens takes torch's batched GEMM, which blocks by the row count). The prompts are
longer than that limit, so the reference's whole-prompt prefill is such a step."""
from __future__ import annotations

import pytest
import torch

from appliance import SamplingParams
from appliance.config import EngineConfig
from appliance.errors import InvalidRequestError
from appliance.layers import linear
from appliance.layers.methods import floating
from helpers import assert_logits_rows_equal, logits_one_at_a_time, run_capturing_logits

REPEAT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 3
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "cost_aware": False, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
SETUPS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "w8a8": dict(dtype="float32", quantization="w8a8"),
    "w4a8": dict(dtype="float32", quantization="w4a8"),
    "moe_float32": dict(dtype="float32"),
    # the other families' own ops (Gemma's soft-capping and sliding windows, Qwen2-MoE's shared expert
    # gate, Phi-3's longrope)
    "qwen2_moe": dict(dtype="float32"),
    "gemma2": dict(dtype="float32"),
    "gemma3": dict(dtype="float32"),
    "phi3": dict(dtype="float32"),
}
SCHEDULES = {
    "batched_ngram": dict(speculative_config=NGRAM),
    "chunked_prefill_ngram": dict(speculative_config=NGRAM, max_num_batched_tokens=8),
    "preemption_ngram": dict(speculative_config=NGRAM, num_kv_blocks=48, block_size=8),
    "batched_prefix_cache": dict(),
}
CASES = ([("float32", c) for c in SCHEDULES]
         + [(s, c) for s in ("w8a8", "w4a8", "bfloat16", "moe_float32")
            for c in ("chunked_prefill_ngram", "batched_prefix_cache")]
         + [(s, "chunked_prefill_ngram") for s in ("qwen2_moe", "gemma2", "gemma3", "phi3")])


@pytest.fixture(autouse=True)
def own_choice_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(linear, "_choice_cache_path", lambda: tmp_path / "linear_backends.json")


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from appliance.engine.tokenizer import load_tokenizer

    dense = tiny_model_dir("llama", num_kv_heads=2, num_attention_heads=6, head_dim=64, hidden_size=96,
                           max_position_embeddings=1024)
    moe = tiny_model_dir("qwen3_moe", max_position_embeddings=1024)
    # Gemma: a local layer whose window (40) the longer prompts pass
    families = {a: tiny_model_dir(a, max_position_embeddings=1024, **({"sliding_window": 40} if "gemma" in a else {}))
                for a in ("qwen2_moe", "gemma2", "gemma3", "phi3")}
    tok = load_tokenizer(str(dense))
    # shared prefixes; three prompts longer than the native float GEMM's default row limit
    texts = [REPEAT * 2 + "The quick", REPEAT * 3 + "def f(x)", "Hello", REPEAT * 4 + "Paris"]
    ids = [tok.encode(t) for t in texts]
    assert sum(len(p) > floating.NATIVE_F32_DEFAULT_MAX_ROWS for p in ids) >= 3
    return {"dense": dense, "moe": moe, **families}, ids


def _model(models, setup):
    return models.get(setup) or models["moe" if setup.startswith("moe") else "dense"]


@pytest.fixture(scope="module")
def references(models):
    paths, ids = models
    cache = {}

    def get(setup):  # one request at a time, each prompt in one step
        if setup not in cache:
            cfg = dict(SETUPS[setup], batch_invariant=True, enable_prefix_caching=False)
            cache[setup] = logits_one_at_a_time(_model(paths, setup), ids, GREEDY, cfg)
        return cache[setup]

    return get


@pytest.mark.parametrize("setup,schedule", CASES)
def test_logits_bits_do_not_depend_on_the_schedule(models, references, setup, schedule):
    paths, ids = models
    ref_outs, ref_rows = references(setup)
    outs, rows = run_capturing_logits(_model(paths, setup), ids, GREEDY,
                                      dict(SETUPS[setup], batch_invariant=True, **SCHEDULES[schedule]), stagger=2)
    assert outs == ref_outs
    assert_logits_rows_equal(rows, ref_rows, outs, (setup, schedule))


def test_prefill_sized_steps_stay_on_the_panel_kernel(models, monkeypatch):
    """What the mode changes: without it a whole-prompt step of more than NATIVE_F32_MAX_ROWS tokens
    leaves the one-call stack for the per-op path, whose native layers run torch's batched GEMM over
    their panels; with it no step does."""
    paths, ids = models
    calls = []
    real = floating._panels_matmul
    monkeypatch.setattr(floating, "_panels_matmul", lambda p, x: calls.append(x.shape[0]) or real(p, x))
    for invariant in (False, True):
        calls.clear()
        run_capturing_logits(paths["dense"], ids[:2], GREEDY,
                             dict(dtype="float32", linear_backend="native", batch_invariant=invariant))
        if invariant:
            assert calls == []
        else:
            assert calls and min(calls) > floating.NATIVE_F32_MAX_ROWS


def test_refused_where_there_is_no_row_invariant_path(models):
    from appliance.engine.llm_engine import LLMEngine
    from appliance.layers import methods

    paths, _ = models
    for bad, why in ((dict(attention_backend="reference"), "needs the CPU's native kernels"),
                     (dict(device="cuda"), "needs the CPU's native kernels.*device='cuda'"),
                     (dict(tensor_parallel_size=2), "runs with tensor_parallel_size 1 only.*got 2")):
        with pytest.raises(InvalidRequestError, match=f"batch_invariant {why}") as e:
            EngineConfig(model=str(paths["dense"]), batch_invariant=True, **bad)
        assert e.value.param == "batch_invariant"
    for backend in ("torch", "onednn"):
        with pytest.raises(InvalidRequestError, match=f"linear_backend={backend} is not row-invariant.*native"):
            LLMEngine(EngineConfig(model=str(paths["dense"]), dtype="float32", batch_invariant=True,
                                   linear_backend=backend))
    # a W8 layer with zero points adds their term with torch's addmm: that packing is not row-invariant
    w8 = methods.get("w8a8_native")
    assert w8.row_invariant_pack({"offset_t": torch.ones(2, 16)}) is None
    assert w8.row_invariant_pack({"offset_t": None}) == {"offset_t": None}
    assert not methods.get("torch").row_invariant and not methods.get("w8a8_onednn").row_invariant


def test_vllm_environment_variable():
    from appliance import vllm_compat
    from appliance.errors import ApplianceError

    assert vllm_compat.vllm_env_engine_kwargs({}, {"VLLM_BATCH_INVARIANT": "1"}) == {"batch_invariant": True}
    assert vllm_compat.vllm_env_engine_kwargs({}, {"VLLM_BATCH_INVARIANT": "0"}) == {"batch_invariant": False}
    # a flag or APPLIANCE_BATCH_INVARIANT wins
    assert vllm_compat.vllm_env_engine_kwargs({"batch_invariant": False}, {"VLLM_BATCH_INVARIANT": "1"}) == {}
    assert vllm_compat.vllm_env_engine_kwargs({}, {"VLLM_BATCH_INVARIANT": "1", "APPLIANCE_BATCH_INVARIANT": "0"}) == {}
    with pytest.raises(ApplianceError, match="VLLM_BATCH_INVARIANT must be 0 or 1, got 'yes'"):
        vllm_compat.vllm_env_engine_kwargs({}, {"VLLM_BATCH_INVARIANT": "yes"})
