"""Sampling against references: seeded reproducibility, stop conditions, n > 1, logprobs equal to
transformers' log_softmax, penalties against a teacher-forced reference, distribution checks."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

from appliance import LLM, SamplingParams
from appliance.engine.request import Request
from appliance.engine.sampler import Sampler


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", num_kv_blocks=512)


@pytest.fixture(scope="module")
def hf(llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)


PROMPT = "The quick brown fox jumps over"


def greedy(llm, prompt=PROMPT, **kw):
    kw.setdefault("max_tokens", 24)
    return llm.generate([prompt], SamplingParams(temperature=0, ignore_eos=True, **kw))[0].outputs[0]


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPT], sp)[0].outputs[0].token_ids
    again = llm.generate([PROMPT], sp)[0].outputs[0].token_ids
    assert alone == again
    noise = SamplingParams(temperature=1.3, max_tokens=20, ignore_eos=True)
    batch = llm.generate(["Hello", PROMPT, "Paris is", "def f(x)"], [noise, sp, noise, noise])
    assert batch[1].outputs[0].token_ids == alone
    other = llm.generate([PROMPT], sp.clone(seed=99))[0].outputs[0].token_ids
    assert other != alone  # 16 tokens from a near-uniform 384-way distribution


def test_stop_string_across_tokens_is_excluded(llm):
    full = greedy(llm)
    toks = full.token_ids
    tok = llm.get_tokenizer()
    # a stop string spanning the boundary between output tokens 5 and 6
    a, b = tok.decode(toks[:6]), tok.decode(toks[:7])
    prefix_len = len(tok.decode(toks[:5]))
    stop = b[prefix_len + max(0, len(a) - prefix_len - 1): prefix_len + (len(a) - prefix_len) + 1]
    assert len(stop) >= 2
    idx = full.text.find(stop)
    out = greedy(llm, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:idx]
    inc = greedy(llm, stop=[stop], include_stop_str_in_output=True)
    assert inc.text == full.text[: idx + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    full = greedy(llm)
    stop_id = full.token_ids[3]
    first = full.token_ids.index(stop_id)
    out = greedy(llm, stop_token_ids=[stop_id])
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_id
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(full.token_ids[:first])  # the stop token's text is not output
    later = greedy(llm, stop_token_ids=[stop_id], min_tokens=first + 2)
    assert len(later.token_ids) >= first + 2
    assert stop_id not in later.token_ids[: first + 1]


def test_max_tokens_gives_length(llm):
    out = greedy(llm, max_tokens=5)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_eos_stops_unless_ignored(llama_dir):
    # Make the model's greedy 3rd token its EOS: the engine must stop there, or not with ignore_eos.
    probe = LLM(str(llama_dir), dtype="float32", num_kv_blocks=256)
    toks = greedy(probe, max_tokens=8).token_ids
    eng = probe.engine
    eng.eos_token_ids = (toks[2],)
    out = probe.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert out.token_ids == toks[: toks.index(toks[2]) + 1] and out.finish_reason == "stop"
    assert out.stop_reason is None
    out = probe.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == toks


def test_n_samples_share_prompt_blocks(llm):
    prompt = PROMPT * 8  # several full blocks
    pool = llm.engine.kv.pool
    hits = pool.num_hits
    outs = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))
    o = outs[0].outputs
    assert [c.index for c in o] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in o)
    assert len({tuple(c.token_ids) for c in o}) > 1  # different seeds per child
    n_full = (len(outs[0].prompt_token_ids) - 1) // 16
    assert pool.num_hits - hits >= 2 * n_full * 16  # children 1 and 2 reuse child 0's blocks
    g = llm.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True))[0].outputs
    assert g[0].token_ids == g[1].token_ids


def test_logprobs_equal_log_softmax_of_reference(llm, hf):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5,
                                                 prompt_logprobs=3))[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    P = len(out.prompt_token_ids)
    cum = 0.0
    for j, (tid, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        row = ref[P - 1 + j]
        assert len(lp) in (5, 6) and tid in lp
        top = torch.topk(row, 5)
        assert set(top.indices.tolist()) <= set(lp)
        for t, v in lp.items():
            assert abs(v - row[t].item()) < 1e-4
        cum += lp[tid]
    assert abs(out.outputs[0].cumulative_logprob - cum) < 1e-6
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == P
    for i in range(1, P):
        assert abs(plp[i][ids[i]] - ref[i - 1, ids[i]].item()) < 1e-4


def test_repetition_penalty_matches_transformers(llm, hf, llama_dir):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPT)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5))[0].outputs[0].token_ids
    g = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=16, do_sample=False, repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)
    assert out == g[0, len(ids):].tolist()
    assert out != greedy(llm, max_tokens=16).token_ids  # the penalty changed something


def test_presence_frequency_penalty_teacher_forced(llm, hf):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPT)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=0.7, frequency_penalty=0.9)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=sp)[0].outputs[0].token_ids
    seq = list(ids)
    for t in out:
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(seq[len(ids):], dtype=torch.long), minlength=logits.numel()).float()
        logits -= 0.9 * counts + 0.7 * (counts > 0).float()
        assert t == int(logits.argmax())
        seq.append(t)


def test_topk1_topp_tiny_minp1_equal_greedy(llm):
    ref = greedy(llm, max_tokens=10).token_ids
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        out = llm.generate([PROMPT], SamplingParams(temperature=0.9, seed=3, max_tokens=10, ignore_eos=True, **kw))
        assert out[0].outputs[0].token_ids == ref, kw


@pytest.mark.parametrize("kw,expected", [
    (dict(), [0.5, 0.3, 0.15, 0.05]),
    (dict(top_k=3), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    (dict(top_p=0.8), [0.625, 0.375, 0.0, 0.0]),
    (dict(min_p=0.2), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    (dict(temperature=0.5), [0.25 / 0.365, 0.09 / 0.365, 0.0225 / 0.365, 0.0025 / 0.365]),
])
def test_sampler_distribution(kw, expected):
    """20k draws from a known 4-token distribution: frequencies within 4 standard errors."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    n = 20000
    sampler = Sampler(torch.device("cpu"), seed=0)
    params = dict(temperature=1.0, max_tokens=1)
    params.update(kw)
    reqs = [Request(str(i), [0], SamplingParams(**params), (), 1) for i in range(n)]
    toks = torch.tensor([r.token_id for r in sampler(logits.repeat(n, 1), reqs)])
    freq = torch.bincount(toks, minlength=4).float() / n
    for f, e in zip(freq.tolist(), expected):
        se = math.sqrt(max(e * (1 - e), 1e-12) / n)
        assert abs(f - e) <= 4 * se + 1e-9, (kw, freq, expected)


def test_engine_without_detokenization_never_decodes_and_stops_on_request(llama_dir):
    """The server's engine core (detokenize=False) gives the same tokens as the offline engine,
    never calls the tokenizer's decode, and ``stop_sequences`` (what the frontend sends when a stop
    string matched) frees the sequence's blocks at once with no further output for it."""
    from appliance.config import EngineConfig
    from appliance.engine.llm_engine import LLMEngine

    cfg = EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=256)
    sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=12, n=2, stop=["never matches"])
    ref_engine = LLMEngine(cfg)
    ref_engine.add_request("a", PROMPT, sp)
    ref = {}
    while ref_engine.has_unfinished_requests():
        for o in ref_engine.step():
            ref = o
    engine = LLMEngine(cfg, detokenize=False)

    def no_decode(*a, **k):
        raise AssertionError("the engine core decoded text")

    engine.tokenizer.decode = no_decode
    engine.add_request("a", PROMPT, sp)
    engine.add_request("b", PROMPT, SamplingParams(temperature=0, ignore_eos=True, max_tokens=12))
    idle_usage, seen_after_stop, last = None, [], {}
    for step in range(40):
        if not engine.has_unfinished_requests():
            break
        outs = engine.step()
        engine.check_integrity()
        for o in outs:
            last[o.request_id] = o
            assert all(c.text == "" for c in o.outputs)
            if o.request_id == "b" and step >= 4:
                seen_after_stop.append(o)
        if step == 3:
            usage = engine.kv_cache_usage()
            assert engine.stop_sequences("b", [0]) is True  # b's only sequence: b is dropped
            assert engine.kv_cache_usage() < usage
            assert engine.stop_sequences("a", [1]) is False  # a's first sequence still runs
    assert not engine.has_unfinished_requests() and not seen_after_stop
    assert engine.kv_cache_usage() == 0.0
    a = last["a"]
    assert a.outputs[0].token_ids == ref.outputs[0].token_ids and a.outputs[0].finish_reason == "length"
    assert a.outputs[1].finish_reason == "stop" and len(a.outputs[1].token_ids) == 4
    assert a.outputs[1].token_ids == ref.outputs[1].token_ids[:4]
