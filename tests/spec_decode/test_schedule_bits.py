"""A token's logits are the same bits however the engine schedules it: alone or batched, decoded one
by one or verified in a speculative chunk, its prompt prefilled whole, in chunks, or partly from the
prefix cache, before or after a preemption. Greedy identity (test_spec_engine.py) holds on the tiny
model with margin to spare; at the default model's scale, quantized, a last-bit difference became a
different greedy token within 100 tokens (bench/results/spec_native_quant.txt). So here every logits
row a run computes for a position whose tokens are the final ones is compared, bit for bit, with the
plainest run's (one request at a time, whole prompts, no speculation, no prefix cache).

The model runs the native kernels (native_layers): integer-GEMM methods (W4A8, W8A8: activations
quantized per token, integer sums) and the native float GEMM, with the native attention, in whichever
kernel variant the host (or APPLIANCE_KERNELS) selects."""
from __future__ import annotations

import pytest

from appliance import SamplingParams
from helpers import assert_logits_rows_equal, logits_one_at_a_time, run_capturing_logits

REPEAT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 3
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run(model, ids, cfg: dict, stagger=0):
    return run_capturing_logits(model, ids, GREEDY, {"dtype": "float32", **cfg}, stagger)


SETUPS = {
    "w4a8": dict(quantization="w4a8"),
    "w8a8": dict(quantization="w8a8"),
    "float32_native": dict(),
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "cost_aware": False, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
SCHEDULES = {
    "batched_ngram": dict(speculative_config=NGRAM),
    "chunked_prefill_ngram": dict(speculative_config=NGRAM, max_num_batched_tokens=8),
    "preemption_ngram": dict(speculative_config=NGRAM, num_kv_blocks=48, block_size=8),  # ~64 needed at once
    "batched_prefix_cache": dict(),
}


@pytest.fixture(scope="module")
def model_and_prompts(tiny_model_dir):
    # head size 64: the attention's partitions are 256 tokens (a smaller head has longer ones), so the
    # longest prompt (286 tokens) crosses one, and the outputs of the next longest pass 128 (a softmax
    # chunk's edge)
    model = tiny_model_dir("llama", num_kv_heads=2, num_attention_heads=6, head_dim=64, hidden_size=96,
                           max_position_embeddings=1024)
    from appliance.engine.tokenizer import load_tokenizer
    tok = load_tokenizer(str(model))
    texts = [REPEAT + "The quick", REPEAT * 2 + "def f(x)", "Hello", REPEAT * 5 + "Paris"]  # shared prefixes
    return model, [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def references(model_and_prompts):
    model, ids = model_and_prompts
    cache = {}

    def get(setup):  # one request at a time
        if setup not in cache:
            cache[setup] = logits_one_at_a_time(model, ids, GREEDY, {"dtype": "float32", **SETUPS[setup],
                                                                     "enable_prefix_caching": False})
        return cache[setup]

    return get


@pytest.fixture(autouse=True)
def native_layers(monkeypatch, tmp_path):
    """Every layer on the native kernels, whatever `auto` would time as fastest on this host (a float
    lm_head beside quantized layers included; elsewhere torch's or oneDNN's GEMMs, which sum a row in
    another order at other row counts), with the choices kept out of the host's cache; and float32
    layers on the native panel GEMM at every step size: by default a step of more than
    NATIVE_F32_MAX_ROWS tokens (a prefill) takes torch's batched GEMM over the panels (floating.py)."""
    from appliance.layers import linear
    from appliance.layers.methods import floating

    def native_first(m, key, cands, rows, prior):
        for name in ("native", "w8a8_native", "w4a8_native"):
            if name in cands:
                return name, None
        raise AssertionError(f"no native method among {cands} for {key}")

    monkeypatch.setattr(linear, "_time_choice", native_first)
    monkeypatch.setattr(linear, "_choice_cache_path", lambda: tmp_path / "linear_backends.json")
    monkeypatch.setattr(floating, "NATIVE_F32_MAX_ROWS", 1 << 20)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("setup", list(SETUPS))
def test_logits_bits_do_not_depend_on_the_schedule(model_and_prompts, references, setup, schedule):
    model, ids = model_and_prompts
    ref_outs, ref_rows = references(setup)
    outs, rows = run(model, ids, dict(SETUPS[setup], **SCHEDULES[schedule]), stagger=2)
    assert outs == ref_outs
    assert_logits_rows_equal(rows, ref_rows, outs, (setup, schedule))
