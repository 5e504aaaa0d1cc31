"""Helpers shared by test modules."""
from __future__ import annotations

import torch

from appliance import SamplingParams
from appliance.engine.request import Request
from appliance.engine.scheduler import SchedulerOutput


def engine_logits(llm, ids: list[int]) -> torch.Tensor:
    """Last-token float32 logits of one prompt through the engine's model runner (whole-prompt
    prefill through the paged KV cache), without sampling."""
    eng = llm.engine
    req = Request("logits-probe", ids, SamplingParams(max_tokens=1), (), 1)
    assert eng.kv.allocate_slots(req, len(ids))
    try:
        logits, _ = eng.runner.execute(SchedulerOutput([(req, len(ids))], len(ids)))
    finally:
        eng.kv.free(req)
    return logits[0]
