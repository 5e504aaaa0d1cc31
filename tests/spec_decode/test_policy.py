"""The draft-length policy (appliance/engine/spec_decode/policy.py): the drafts it keeps give the
highest expected tokens per second of all allocations that keep each request's first draft (checked
against brute force over every such allocation under the geometric acceptance model), untried sizes
are tried, noise only ever raises a measured time, and in the engine the trimming leaves greedy
output unchanged."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from appliance import SamplingParams
from appliance.config import EngineConfig
from appliance.engine.llm_engine import LLMEngine
from appliance.engine.spec_decode.policy import KEEP_MARGIN, PRIOR_ALPHA, DraftLengthPolicy

# a decode step's time by tokens in it, shaped like a GEMM that runs rows three at a time: flat up to
# 3 rows, a step at 4, flat to 6, another step at 7
PANEL_TIMES = {1: 1.00, 2: 1.00, 3: 1.02, 4: 1.20, 5: 1.21, 6: 1.23, 7: 1.42, 8: 1.43, 9: 1.45, 10: 1.62,
               11: 1.63, 12: 1.65, 13: 1.85, 14: 1.86, 15: 1.88}


def _policy(times=PANEL_TIMES, draft_s=None):
    p = DraftLengthPolicy()
    for n, t in times.items():
        p.observe_step(n, t)
    if draft_s is not None:
        p.observe_draft(draft_s)
    return p


def _rate(policy, base, alphas, counts, draft_model):
    tokens = base + sum(sum(a ** j for j in range(1, c + 1)) for a, c in zip(alphas, counts))
    t = policy.step_time(base + sum(counts)) + max(counts, default=0) * (policy.draft_time() if draft_model else 0)
    return tokens / t


@pytest.mark.parametrize("base, alphas, caps, draft_s", [
    (1, [0.09], [3], None),           # open-ended text under n-gram lookup: one draft pays, three do not
    (1, [0.85], [3], None),           # copied text: every draft pays
    (1, [0.85], [5], None),           # past the step at 4 tokens: 6 is worth it
    (2, [0.9, 0.1], [4, 4], None),    # two requests: the good one gets the drafts
    (3, [0.6, 0.3, 0.05], [3, 3, 3], None),
    (1, [0.7], [4], 0.30),            # a draft model whose forward costs 30% of the target's step
    (2, [0.95, 0.5], [4, 4], 0.10),
    (1, [0.02], [4], None),
    (1, [0.95], [3], 0.20),           # a near tie between 2 and 3 drafts: the longer is kept
])
def test_choice_is_the_best_allocation(base, alphas, caps, draft_s):
    policy = _policy(draft_s=draft_s)
    draft_model = draft_s is not None
    got = policy.choose(base, alphas, caps, draft_model)
    assert all(0 <= g <= c for g, c in zip(got, caps))
    assert all(g >= 1 for g in got)  # the first draft is kept: the acceptance pause decides about none
    best = max(_rate(policy, base, alphas, counts, draft_model)
               for counts in itertools.product(*(range(1, c + 1) for c in caps)))
    # the best, or more drafts at most KEEP_MARGIN below it; never fewer drafts than the best
    rate = _rate(policy, base, alphas, got, draft_model)
    assert (1 - KEEP_MARGIN) * best <= rate <= best * (1 + 1e-12)
    fewest_best = min(sum(c) for c in itertools.product(*(range(1, c + 1) for c in caps))
                      if _rate(policy, base, alphas, c, draft_model) == pytest.approx(best, rel=1e-12))
    assert sum(got) >= fewest_best


def test_choice_on_the_panel_times():
    policy = _policy()
    # open-ended text: the 4-token step (1.2x) does not pay; 3 tokens cost 2% for 0.8% (within the margin)
    assert policy.choose(1, [0.09], [3], False) == [2]
    assert policy.choose(1, [0.85], [3], False) == [3]
    assert policy.choose(1, [0.45], [3], False) == [2]
    dear = _policy({1: 1.0, 2: 1.15, 3: 1.3, 4: 1.45})
    assert dear.choose(1, [0.1], [3], False) == [1]  # never fewer than one
    assert dear.num_trimmed == 2


def test_untried_sizes_are_tried_and_no_decode_time_means_no_trimming():
    assert DraftLengthPolicy().choose(1, [0.01], [3], False) is None  # no decode step timed
    only_one = _policy({1: 1.0})
    assert only_one.choose(1, [0.01], [3], False) == [3]  # 2..4 never measured: as cheap as 1
    only_one.observe_step(4, 2.0)
    assert only_one.choose(1, [0.3], [3], False) == [2]  # 2 and 3 still count as 1's time


def test_least_recent_time_counts():
    policy = _policy({1: 1.0, 2: 1.0})
    policy.observe_step(2, 5.0)  # a co-tenant's spike
    assert policy.step_time(2) == 1.0
    assert policy.step_time(3) == 1.0  # not measured: the size below


def _req():
    return SimpleNamespace(spec_run_counts=(0.0, 0.0))


def test_acceptance_estimate():
    req = _req()
    assert DraftLengthPolicy.alpha(req) == PRIOR_ALPHA
    for _ in range(50):
        DraftLengthPolicy.record(req, 3, 3)
    assert DraftLengthPolicy.alpha(req) > 0.9
    for _ in range(50):
        DraftLengthPolicy.record(req, 3, 0)
    assert DraftLengthPolicy.alpha(req) < 0.1
    for _ in range(50):
        DraftLengthPolicy.record(req, 4, 1)  # one accepted, then a rejection: alpha 1/2
    assert DraftLengthPolicy.alpha(req) == pytest.approx(0.5, abs=0.01)


def _engine(llama_dir, **kw):
    return LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=256, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}, **kw))


def _generate(engine, ids, max_tokens=24):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(ids):
        engine.add_request(str(i), p, sp)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return [out[str(i)] for i in range(len(ids))]


def test_engine_trims_drafts_that_do_not_pay_and_output_is_unchanged(llama_dir):
    plain = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=256))
    text = "The quick brown fox jumps over the lazy dog. " * 4
    ids = [plain.tokenize(text + "The quick"), plain.tokenize(text + "The lazy")]
    want = _generate(plain, ids)

    # every extra token costs as much as the step: no draft after the first can pay
    dear = _engine(llama_dir)
    dear.spec.policy.step_time = lambda n: float(n)
    assert _generate(dear, ids) == want
    st = dear.spec.stats()
    assert st["spec_decode_num_draft_tokens"] == st["spec_decode_num_drafts"] > 0
    assert st["spec_decode_num_trimmed_tokens"] > 0

    # measured times: every decode-only step's size is recorded (1 + drafts per request)
    free = _engine(llama_dir)
    assert _generate(free, ids) == want
    st = free.spec.stats()
    assert st["spec_decode_num_draft_tokens"] > 0 and st["spec_decode_num_accepted_tokens"] > 0
    sizes = set(free.spec.policy._step_s)
    assert all(1 <= n <= 2 * 4 for n in sizes) and max(sizes) > 2, sizes  # two requests, up to 3 drafts each


def test_engine_with_a_draft_model_measures_its_one_token_forwards(llama_dir):
    """A draft as large as its target: greedy output unchanged whatever the policy keeps, and the
    draft's cost is learned from forwards that fed one token per request (not the first forward
    that catches the draft's cache up with the whole prompt)."""
    plain = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=256))
    ids = [plain.tokenize("The quick brown fox jumps over the lazy dog. " * 3)]
    want = _generate(plain, ids)
    eng = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=256, speculative_config={
        "method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3}))
    seen = []
    propose = eng.spec.draft.propose

    def spy(reqs, sampler):
        before = {r.request_id: r.num_tokens - r.spec_num_computed for r in reqs}
        propose(reqs, sampler)
        seen.append((max(before.values()), len(eng.spec.draft.forward_seconds), max(len(r.spec_token_ids) for r in reqs)))

    eng.spec.draft.propose = spy
    assert _generate(eng, ids) == want
    assert seen and eng.spec.policy.draft_time() > 0
    for catch_up, timed, k in seen:  # k forwards; the first is timed only if it fed one token
        assert timed == (k if catch_up == 1 else k - 1), seen
