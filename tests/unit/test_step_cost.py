"""The step-cost fit and the prefill cap it gives the scheduler (engine/step_cost.py): the fit against
synthetic steps with known coefficients, the cap's formula, and an engine run where a long prompt
arrives while a request decodes: the decode gets a token every step, the prompt is split into capped
chunks, and every token equals the uncapped run's."""
from __future__ import annotations

import random

import pytest

from appliance import SamplingParams
from appliance.config import EngineConfig
from appliance.engine.llm_engine import LLMEngine
from appliance.engine.step_cost import AUTO_FACTOR, MIN_PREFILL_CHUNK, StepCostModel, parse_itl_target
from appliance.errors import InvalidRequestError


def test_fit_recovers_the_coefficients():
    rng = random.Random(0)
    m = StepCostModel()
    assert m.coefficients() is None
    for _ in range(200):
        t = rng.randrange(1, 2048)
        m.observe(t, 0.015 + 0.0004 * t + rng.uniform(-1e-4, 1e-4))  # +-0.1 ms of noise
    fixed, per_token = m.coefficients()
    assert fixed == pytest.approx(0.015, abs=2e-4) and per_token == pytest.approx(0.0004, rel=0.01)
    assert m.predict(1000) == pytest.approx(0.415, rel=0.01)


def test_fit_follows_a_change_and_survives_degenerate_input():
    m = StepCostModel()
    for i in range(100):
        m.observe(100 + i % 7 * 50, 0.001 * (100 + i % 7 * 50))
    for i in range(300):  # the host got twice as slow
        m.observe(100 + i % 7 * 50, 0.002 * (100 + i % 7 * 50))
    assert m.coefficients()[1] == pytest.approx(0.002, rel=0.02)
    same = StepCostModel()
    for _ in range(20):
        same.observe(64, 0.032)  # every step the same size: everything per token
    assert same.coefficients() == (0.0, pytest.approx(0.0005))
    same.observe(0, 1.0), same.observe(10, float("nan"))  # ignored
    assert same.n == 20


def test_cap_formula():
    m = StepCostModel()
    m.frozen = (0.02, 0.0005)
    assert m.prefill_cap(0, "auto") is None and m.prefill_cap(4, None) is None
    decode = 0.02 + 0.0005 * 4
    assert m.prefill_cap(4, "auto") == int((AUTO_FACTOR * decode - decode) / 0.0005)
    assert m.prefill_cap(4, 0.1) == int((0.1 - decode) / 0.0005)
    assert m.prefill_cap(4, 0.001) == MIN_PREFILL_CHUNK  # progress even under an impossible target


@pytest.mark.parametrize("bad", ["fast", "0", "-5", "inf", ""])
def test_bad_targets_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="itl_target"):
        parse_itl_target(bad)
    with pytest.raises(InvalidRequestError, match=f"itl_target.*got {bad!r}"):
        EngineConfig(itl_target=bad)
    assert parse_itl_target("250") == 0.25 and parse_itl_target("auto") == "auto" and parse_itl_target("off") is None


def _run(llama_dir, itl_target, frozen=None):
    eng = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", itl_target=itl_target, num_kv_blocks=128,
                                 block_size=4))
    if frozen:
        eng.scheduler.step_cost.frozen = frozen
    steps = []
    real = eng.scheduler.schedule

    def schedule():
        out = real()
        steps.append([(r.request_id, n, r.num_tokens - r.num_computed_tokens) for r, n in out.scheduled])
        return out

    eng.scheduler.schedule = schedule
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    rng = random.Random(1)
    eng.add_request("decoder", [rng.randrange(3, 384) for _ in range(8)], sp)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        eng.check_integrity()
        if len(steps) == 3:  # "decoder" is decoding now: a long prompt arrives
            eng.add_request("prompt", [rng.randrange(3, 384) for _ in range(300)], sp)
    return done, steps, eng


def test_decodes_keep_going_while_a_long_prompt_is_prefilled(llama_dir):
    frozen = (0.02, 0.0005)
    cap = StepCostModel()
    cap.frozen = frozen
    limit = cap.prefill_cap(1, "auto")
    want, plain, _ = _run(llama_dir, "off")
    got, steps, eng = _run(llama_dir, "auto", frozen)
    assert got == want  # same tokens, greedy
    # uncapped: the whole 300-token prompt in one step beside the decode
    assert any(dict((r, n) for r, n, _ in s).get("prompt") == 300 for s in plain)
    chunks = []
    for s in steps:
        by_id = {r: (n, left) for r, n, left in s}
        if "decoder" in by_id and by_id["decoder"][1] == 1 and by_id.get("prompt", (0, 0))[1] > 1:
            chunks.append(by_id["prompt"][0])
            assert by_id["prompt"][0] <= limit
    assert sum(chunks) == 300 and len(chunks) == -(-300 // limit)
    assert eng.scheduler.num_capped_steps == len(chunks) - 1  # the last chunk fits under the cap
    # the decoder never waits: it is in every step from its first token to its last
    first = next(i for i, s in enumerate(steps) if ("decoder", 1, 1) in s)
    assert all(any(r == "decoder" for r, _, _ in s) for s in steps[first:first + 39])
