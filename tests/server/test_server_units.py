"""Server pieces without a server: stream plumbing, the engine-core delta encoder, metrics text,
request validation."""
from __future__ import annotations

import asyncio

import pytest

from appliance.server.async_engine import RequestAborted, RequestStream, _ABORTED, iterate_streams
from appliance.server.engine_core import ChoiceDelta, EngineCore, RequestDelta
from appliance.server.metrics import Histogram, ServerMetrics
from appliance.server.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, validation_error


def delta(rid, text, finished, first=False):
    return RequestDelta(rid, [ChoiceDelta(0, text, [1], None, None, "length" if finished else None, None)],
                        finished, first=first)


def test_iterate_streams_reads_a_delta_queued_before_iteration_starts():
    async def run():
        q = asyncio.Queue()
        a, b = RequestStream("a", 3, 1, q), RequestStream("b", 3, 1, q)
        # the reader already delivered everything and flagged both finished
        for d in (delta("a", "x", False, True), delta("b", "y", True, True), delta("a", "z", True)):
            q.put_nowait(d)
        a.finished = b.finished = True
        return [(d.request_id, d.choices[0].text) async for d in iterate_streams([a, b])]

    assert asyncio.run(run()) == [("a", "x"), ("b", "y"), ("a", "z")]


def test_iterate_streams_raises_on_server_abort():
    async def run():
        q = asyncio.Queue()
        s = RequestStream("a", 3, 1, q)
        q.put_nowait(delta("a", "x", False, True))
        q.put_nowait(_ABORTED)
        return [d async for d in iterate_streams([s])]

    with pytest.raises(RequestAborted):
        asyncio.run(run())


class _FakeEngine:
    """Replays cumulative RequestOutputs, as LLMEngine.step returns them."""

    def __init__(self, steps):
        self.steps = list(steps)
        self.added = []

    def add_request(self, rid, ids, params):
        self.added.append(rid)

    def step(self):
        return self.steps.pop(0)

    def abort_request(self, ids):
        pass


def test_engine_core_sends_token_deltas_of_cumulative_outputs():
    """The core sends new token ids only (no text: it never detokenizes), and a choice's end once."""
    from appliance.engine.llm_engine import CompletionOutput, RequestOutput
    from appliance.sampling_params import SamplingParams
    from appliance.server.engine_core import AddRequest

    def out(ids, fin):
        return RequestOutput("r", None, [5, 6], [CompletionOutput(i, "", list(x), None, None, f)
                                                 for i, (x, f) in enumerate(zip(ids, fin))],
                             finished=all(fin), prompt_logprobs=None)

    steps = [[out([[1], [2]], [None, None])],
             [out([[1, 3], [2, 4]], [None, "stop"])],
             [out([[1, 3, 7], [2, 4]], [None, "stop"])],
             [out([[1, 3, 7, 9], [2, 4]], ["length", "stop"])]]
    core = EngineCore(_FakeEngine(steps))
    assert core.add(AddRequest("r", [5, 6], SamplingParams(n=2))) is None
    d1, = core.step()
    assert d1.first and [(c.index, c.text, c.token_ids) for c in d1.choices] == [(0, "", [1]), (1, "", [2])]
    d2, = core.step()
    assert not d2.first and [(c.token_ids, c.finish_reason) for c in d2.choices] == [([3], None), ([4], "stop")]
    d3, = core.step()  # choice 1 ended last step: not repeated
    assert [(c.index, c.token_ids) for c in d3.choices] == [(0, [7])] and not d3.finished
    d4, = core.step()
    assert d4.finished and [(c.index, c.token_ids, c.finish_reason) for c in d4.choices] == [(0, [9], "length")]
    assert core.sent == {}


def test_frontend_applies_text_and_stop_strings_to_core_deltas(llama_dir):
    """RequestStream.apply_text: the frontend's half of the split. A stop string that the core does
    not know about ends the choice, drops the tokens after it (and their logprobs) and is reported
    so that the core can be told to stop the sequence."""
    from transformers import AutoTokenizer

    from appliance.engine.detokenizer import ChoiceText
    from appliance.sampling_params import SamplingParams

    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    ids = tok.encode("one two three four", add_special_tokens=False)
    params = SamplingParams(n=2, stop=["three"], logprobs=0)
    s = RequestStream("r", 2, 2, asyncio.Queue(), [ChoiceText(tok, [5, 6], params) for _ in range(2)])
    cut = next(i for i in range(len(ids)) if "three" in tok.decode(ids[:i + 1]))
    lps = [{t: -0.5} for t in ids]
    d = RequestDelta("r", [ChoiceDelta(0, "", ids, lps, -0.5 * len(ids), None, None),
                           ChoiceDelta(1, "", ids[:1], lps[:1], -0.5, None, None)], False, first=True)
    assert s.apply_text(d) == [0]
    c0, c1 = d.choices
    assert c0.token_ids == ids[:cut + 1] and len(c0.logprobs) == cut + 1
    assert c0.cumulative_logprob == pytest.approx(-0.5 * (cut + 1))
    assert (c0.text, c0.finish_reason, c0.stop_reason) == ("one two ", "stop", "three")
    assert c1.finish_reason is None and not d.finished
    # the core, not yet told, sends choice 0 another token: dropped; choice 1 ends by length
    d2 = RequestDelta("r", [ChoiceDelta(0, "", [ids[-1]], None, None, None, None),
                            ChoiceDelta(1, "", ids[1:2], None, None, "length", None)], True)
    assert s.apply_text(d2) == []
    assert [(c.index, c.finish_reason) for c in d2.choices] == [(1, "length")] and d2.finished
    assert "".join([c1.text, d2.choices[0].text]) == tok.decode(ids[:2])


def test_histogram_and_metrics_text():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    lines = h.lines("x", {"m": "a"})
    assert lines[:3] == ['x_bucket{m="a",le="0.1"} 2', 'x_bucket{m="a",le="1"} 3', 'x_bucket{m="a",le="+Inf"} 4']
    assert lines[-1] == 'x_count{m="a"} 4'
    m = ServerMetrics('we"ird')
    m.finish("length", 10, 5, 0.2, 1.0)
    text = m.render({"num_running": 2, "kv_cache_usage": 0.25})
    assert 'appliance:request_success_total{model_name="we\\"ird",finished_reason="length"} 1' in text
    assert 'appliance:num_requests_running{model_name="we\\"ird"} 2' in text
    assert 'appliance:kv_cache_usage_perc{model_name="we\\"ird"} 0.25' in text
    assert 'appliance:time_per_output_token_seconds_sum{model_name="we\\"ird"} 0.2' in text


def test_validation_errors_name_param_and_value():
    with pytest.raises(Exception) as e:
        CompletionRequest.model_validate({"prompt": "x", "n": "many"})
    err = validation_error(e.value)
    assert isinstance(err, OpenAIError) and err.status == 400 and err.param == "n" and "'many'" in err.message
    with pytest.raises(Exception) as e:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": 3}]})
    assert validation_error(e.value).param.startswith("messages.0.content")
    with pytest.raises(Exception) as e:
        CompletionRequest.model_validate({})
    assert validation_error(e.value).param == "prompt"
