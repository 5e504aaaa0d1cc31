"""Greedy output is token-identical with and without speculation (n-gram, a draft equal to the
target, a draft with other weights), under chunked prefill, prefix caching and preemption, with
stops and length limits inside accepted runs; the block pool is checked after every step and the
prefix cache only ever holds verified tokens."""
from __future__ import annotations

import random
import re

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.sampling_params import StructuredOutputsParams
from appliance.config import EngineConfig
from appliance.engine.llm_engine import LLMEngine
from appliance.engine.block_pool import NULL_BLOCK
from helpers import drive_engine

REPEAT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 3


def prompts(tok):
    rng = random.Random(0)
    texts = [REPEAT + "The quick", REPEAT + "def f(x)", "Hello", "Paris is the capital", "def f(x): return x * 2"]
    ids = [tok.encode(t) for t in texts]
    ids.append([rng.randrange(3, 384) for _ in range(40)])  # nothing repeats: no n-gram drafts at first
    return ids


def check_cached_blocks(engine: LLMEngine) -> None:
    """Every hashed block of a live request holds exactly that request's known tokens there."""
    bs = engine.kv.block_size
    for r in engine.scheduler.requests.values():
        for i, h in enumerate(r.block_hashes):
            b = engine.kv.pool.blocks[r.block_ids[i]] if r.block_ids[i] != NULL_BLOCK else None
            if b is not None:
                assert b.block_hash == h and b.token_ids == tuple(r.all_token_ids[i * bs:(i + 1) * bs]), (r, i)
        assert len(r.block_hashes) <= r.num_tokens // bs


def run_engine(engine: LLMEngine, ids, params, stagger=0):
    return drive_engine(engine, ids, params, stagger, after_step=check_cached_blocks, whole_outputs=True)


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def draft_dirs(tiny_model_dir):
    return {"other_weights": tiny_model_dir("llama", seed=1)}


@pytest.fixture(scope="module")
def reference(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=512))
    ids = prompts(engine.tokenizer)
    # one request at a time, no speculation: the plainest schedule
    return ids, [run_engine(engine, [p], GREEDY)[0].token_ids for p in ids]


SCHEDULES = {
    "batched": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=8),  # budget 8: drafts cut to the budget too
    "preemption": dict(num_kv_blocks=14, block_size=8),  # far too small for 6 requests at once
    "no_prefix_cache": dict(enable_prefix_caching=False),
}


def spec(method, llama_dir, draft_dirs, k=3):
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "cost_aware": False, "prompt_lookup_min": 1,
                "prompt_lookup_max": 3}
    model = llama_dir if method == "draft_same" else draft_dirs["other_weights"]
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, "cost_aware": False}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("method", ["ngram", "draft_same", "draft_other"])
def test_greedy_identical_with_speculation(llama_dir, draft_dirs, reference, method, schedule):
    ids, ref = reference
    cfg = {"dtype": "float32", "num_kv_blocks": 512, **SCHEDULES[schedule]}
    engine = LLMEngine(EngineConfig(model=str(llama_dir), speculative_config=spec(method, llama_dir, draft_dirs),
                                    **cfg))
    # staggered arrivals: later prompts hit the prefix cache of earlier ones mid-speculation
    got = run_engine(engine, ids, GREEDY, stagger=3 if schedule == "batched" else 0)
    assert [o.token_ids for o in got] == ref
    st = engine.spec.stats()
    assert st["spec_decode_num_draft_tokens"] > 0
    if method == "draft_same":  # the target proposing to itself: every draft is accepted
        assert st["spec_decode_acceptance_rate"] == 1.0
    if method == "ngram":
        assert st["spec_decode_num_accepted_tokens"] > 0
    if schedule == "preemption":
        assert engine.scheduler.num_preemptions > 0


def test_rejections_leave_prefix_cache_intact(llama_dir, draft_dirs, reference):
    """A draft that is always wrong (other weights): rejected drafts never reach the prefix cache,
    so the same prompts served again from the cache give the same tokens."""
    ids, ref = reference
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=512,
                                    speculative_config=spec("draft_other", llama_dir, draft_dirs, k=4)))
    first = run_engine(engine, ids, GREEDY)
    st = engine.spec.stats()
    assert st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]  # rejections happened
    hits0 = engine.kv.pool.num_hits
    # again, with each prompt extended by its own output: long prefix-cache hits over speculated blocks
    again = run_engine(engine, [p + o.token_ids for p, o in zip(ids, first)],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert engine.kv.pool.num_hits > hits0
    plain = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=512,
                                   enable_prefix_caching=False))
    want = run_engine(plain, [p + o.token_ids for p, o in zip(ids, first)],
                      SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.token_ids for o in again] == [o.token_ids for o in want]
    assert [o.token_ids for o in first] == ref


def test_length_and_stops_inside_accepted_runs(llama_dir, reference):
    """With the target as its own draft every run is k + 1 = 5 tokens: max_tokens 7, a stop token id
    and a stop string all fall inside a run and cut it there, as without speculation."""
    ids, ref = reference
    base = LLM(str(llama_dir), dtype="float32", num_kv_blocks=512)
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=512,
              speculative_config={"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 4,
                                  "cost_aware": False})
    tok = llm.get_tokenizer()
    p, r = ids[0], ref[0]
    cases = [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[r[8]]),
             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[tok.decode(r[7:9])]),
             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[tok.decode(r[6:8])],
                            include_stop_str_in_output=True)]
    for sp in cases:
        want = base.generate(prompt_token_ids=[p], sampling_params=sp)[0].outputs[0]
        got = llm.generate(prompt_token_ids=[p], sampling_params=sp)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason), sp
        assert len(got.token_ids) < 24
    assert llm.engine.spec.stats()["spec_decode_acceptance_rate"] == 1.0
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.num_blocks


def test_logprobs_and_penalties_with_speculation(llama_dir, reference):
    """Logprobs are the target's at every accepted position, and penalties / min_tokens apply at each
    draft position as without speculation: the same tokens and logprobs (float32, 1e-4)."""
    ids, _ = reference
    base = LLM(str(llama_dir), dtype="float32", num_kv_blocks=512)
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=512,
              speculative_config={"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3,
                                  "cost_aware": False})
    sp = SamplingParams(temperature=0, max_tokens=16, logprobs=3, repetition_penalty=1.3, frequency_penalty=0.5,
                        min_tokens=10, logit_bias={5: 2.0})
    want = base.generate(prompt_token_ids=ids[:3], sampling_params=sp)
    got = llm.generate(prompt_token_ids=ids[:3], sampling_params=sp)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lw.keys() == lg.keys()
            torch.testing.assert_close(torch.tensor(list(lg.values())), torch.tensor(list(lw.values())),
                                       atol=1e-4, rtol=0)
    assert llm.engine.spec.stats()["spec_decode_num_accepted_tokens"] > 0


def test_sampled_speculation_runs_and_is_seeded(llama_dir, draft_dirs, reference):
    """Sampling with speculation (rejection sampling in the engine): seeded requests repeat, the
    pool stays intact, drafts are both accepted and rejected."""
    ids, _ = reference
    outs = []
    for _ in range(2):
        engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=512,
                                        speculative_config=spec("draft_same", llama_dir, draft_dirs, k=3)))
        sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=20, ignore_eos=True, seed=7)
        outs.append([o.token_ids for o in run_engine(engine, ids, sp)])
        st = engine.spec.stats()
        # the draft is the target but draws its own tokens: acceptance is high but not certain
        assert 0 < st["spec_decode_num_accepted_tokens"] <= st["spec_decode_num_draft_tokens"]
    assert outs[0] == outs[1]


def test_speculation_off_for_large_batches_and_structured_output(llama_dir, reference):
    ids, ref = reference
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=512, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "cost_aware": False, "disable_by_batch_size": 2}))
    got = run_engine(engine, ids, GREEDY)
    assert [o.token_ids for o in got] == ref
    assert engine.spec.num_steps_off > 0
    # a constrained request decodes plainly beside a speculating one (the grammar masks' rows stay right)
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=512, speculative_config={
        "method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3, "cost_aware": False}))
    engine.add_request("s", ids[1], SamplingParams(temperature=0, max_tokens=12,
                                                   structured_outputs=StructuredOutputsParams(regex="(ab)+c")))
    assert engine.scheduler.requests["s"].spec_allowed is False
    engine.add_request("g", ids[0], GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        engine.check_integrity()
    assert done["g"].token_ids == ref[0]
    assert re.fullmatch("(ab)+c", done["s"].text) or (done["s"].finish_reason == "length"
                                                      and re.fullmatch("(ab)*a?", done["s"].text))
    assert engine.spec.stats()["spec_decode_num_accepted_tokens"] > 0


def test_low_acceptance_pauses_speculation(llama_dir, draft_dirs, reference):
    """A draft that is (almost) always wrong: after a few steps the request decodes without drafts
    (paused), so it proposes fewer drafts than with the pause disabled, and the tokens are the same."""
    ids, ref = reference
    drafts = {}
    for rate in (0.0, 0.5):
        engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=512, speculative_config={
            **spec("draft_other", llama_dir, draft_dirs, k=2), "min_acceptance_rate": rate}))
        got = run_engine(engine, ids[2:3], GREEDY)
        assert got[0].token_ids == ref[2]
        st = engine.spec.stats()
        drafts[rate] = st["spec_decode_num_drafts"]
        if rate == 0.0:  # never paused: every decode step speculates but (at most) the last, with 1 token left
            assert st["spec_decode_num_drafts"] + st["spec_decode_num_accepted_tokens"] >= len(ref[2]) - 2
    assert drafts[0.5] < drafts[0.0]


def test_ngram_on_a_fully_windowed_model(tiny_model_dir):
    """Every layer windowed (blocks out of the window released to NULL_BLOCK while decoding): drafts,
    their blocks and the released ones coexist; the tokens equal those without speculation."""
    path = tiny_model_dir("mistral", sliding_window=12)
    base = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=256, block_size=4))
    assert base.kv.sliding_window == 12
    ids = prompts(base.tokenizer)[:3]
    want = run_engine(base, ids, GREEDY)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=256, block_size=4,
                                    speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "cost_aware": False}))
    got = run_engine(engine, ids, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engine.spec.stats()["spec_decode_num_draft_tokens"] > 0


def test_draft_quantized_apart_from_the_target(llama_dir, reference):
    """speculative_config.quantization: the target itself as its own draft, quantized to W8A8 while
    the target stays float32. The draft's layers run the quantized scheme, the target's do not, the
    tokens equal those without speculation, and the near-identical draft is mostly accepted."""
    ids, ref = reference
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=512, speculative_config={
        "method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3, "cost_aware": False,
        "quantization": "w8a8"}))
    schemes = lambda runner: {getattr(m, "scheme", "float") for m in runner.model.modules()  # noqa: E731
                              if hasattr(m, "in_features") and hasattr(m, "backend")}
    assert "w8a8" in " ".join(schemes(engine.spec.draft.runner)), schemes(engine.spec.draft.runner)
    assert schemes(engine.runner) == {"float"}, schemes(engine.runner)
    got = run_engine(engine, ids, GREEDY)
    assert [o.token_ids for o in got] == ref
    assert engine.spec.stats()["spec_decode_acceptance_rate"] > 0.5



def test_forced_float_backend_with_a_quantized_draft(tmp_path, caplog):
    """--linear-backend native names the float target's method; a GGUF draft run quantized (every layer
    and its tied vocabulary Q8_0: no float layer) cannot run it. The draft's layers are chosen as under
    auto (said in the log), the target's all run native, and the tokens equal those without
    speculation. A forced backend that the target cannot run is still refused."""
    from gguf_files import tokenizer_vocab, write_llama_gguf

    types = {"token_embd.weight": "Q8_0"}
    for i in range(2):
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            types[f"blk.{i}.{t}.weight"] = "Q8_0"
    path = write_llama_gguf(tmp_path / "q8.gguf", tokenizer_vocab(), types, layers=2, hidden=128, ffn=256,
                            n_head=4, n_kv=2)
    cfg = dict(model=str(path), dtype="float32", num_kv_blocks=256)
    plain = LLMEngine(EngineConfig(**cfg))
    ids = [plain.tokenizer.encode(t) for t in (REPEAT + "The quick", "Paris is the capital")]
    ref = [o.token_ids for o in run_engine(plain, ids, GREEDY)]
    draft = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3, "cost_aware": False,
             "quantization": "gguf"}
    with caplog.at_level("WARNING", logger="appliance"):
        engine = LLMEngine(EngineConfig(linear_backend="native", speculative_config=draft, **cfg))
    assert any("cannot run linear_backend=native" in r.getMessage() for r in caplog.records)
    backends = lambda runner: {m.backend for m in runner.model.modules() if hasattr(m, "backend")  # noqa: E731
                               and hasattr(m, "in_features")}
    assert backends(engine.runner) == {"native"}, backends(engine.runner)
    assert backends(engine.spec.draft.runner) and "native" not in backends(engine.spec.draft.runner)
    assert [o.token_ids for o in run_engine(engine, ids, GREEDY)] == ref
    with pytest.raises(Exception, match="linear_backend=w8a8_native"):
        LLMEngine(EngineConfig(linear_backend="w8a8_native", speculative_config=draft, **cfg))
