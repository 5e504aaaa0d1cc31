"""The speculative decoding counters reach /metrics under vLLM's names and the engine stats."""
from __future__ import annotations

from appliance import SamplingParams
from appliance.config import EngineConfig
from appliance.engine.llm_engine import LLMEngine
from appliance.server.engine_core import engine_stats
from appliance.server.metrics import ServerMetrics


def test_spec_counters_in_metrics(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=128, speculative_config={
        "method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3, "cost_aware": False}))
    engine.add_request("a", engine.tokenize("The quick brown fox"), SamplingParams(temperature=0, max_tokens=9,
                                                                                   ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    st = engine_stats(engine)
    # a 1-token prefill step, then runs of 4 (3 accepted drafts + 1) up to max_tokens 9: 1 + 4 + 4
    assert (st["spec_decode_num_drafts"], st["spec_decode_num_draft_tokens"],
            st["spec_decode_num_accepted_tokens"]) == (2, 6, 6)
    assert st["spec_decode_num_accepted_tokens_per_pos"] == [2, 2, 2]
    assert st["spec_decode_mean_accepted_length"] == 4.0 and st["spec_decode_acceptance_rate"] == 1.0
    text = ServerMetrics("m").render(st)
    for line in ('vllm:spec_decode_num_drafts_total{model_name="m"} 2',
                 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 6',
                 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 6',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 2',
                 'appliance:spec_decode_acceptance_rate{model_name="m"} 1',
                 'appliance:spec_decode_num_trimmed_tokens_total{model_name="m"} 0',  # cost_aware false
                 "# TYPE vllm:spec_decode_num_drafts_total counter"):
        assert line in text.splitlines(), line
    # without speculation: no spec_decode series at all
    assert "spec_decode" not in ServerMetrics("m").render({"num_running": 0})


def test_pause_doubles_while_acceptance_stays_low_and_resets_after_a_good_step():
    from types import SimpleNamespace

    from appliance.engine.spec_decode import MAX_PAUSE_STEPS, PAUSE_STEPS, SpecDecoder
    from appliance.engine.spec_decode.policy import DraftLengthPolicy

    dec = SimpleNamespace(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0, num_accepted_per_pos=[0] * 3,
                          config=SimpleNamespace(min_acceptance_rate=0.2), k=3, policy=DraftLengthPolicy())
    req = SimpleNamespace(spec_acceptance=1.0, spec_pause_len=0, spec_paused_steps=0, spec_num_computed=0,
                          num_computed_tokens=0, spec_k=0, spec_run_counts=(0.0, 0.0))

    def bad_until_paused():
        req.spec_paused_steps = 0  # the previous pause has run out
        while True:
            SpecDecoder.record(dec, req, 3, 0)
            if req.spec_paused_steps:
                return req.spec_paused_steps

    assert [bad_until_paused() for _ in range(6)] == [PAUSE_STEPS, 2 * PAUSE_STEPS, 4 * PAUSE_STEPS,
                                                      8 * PAUSE_STEPS, MAX_PAUSE_STEPS, MAX_PAUSE_STEPS]
    req.spec_paused_steps = 0
    req.spec_acceptance = 0.5  # resumed
    SpecDecoder.record(dec, req, 3, 2)  # a good step (2 of 3 accepted)
    assert req.spec_pause_len == 0
    assert bad_until_paused() == PAUSE_STEPS
    assert dec.num_accepted_tokens == 2 and dec.num_accepted_per_pos == [1, 1, 0]
