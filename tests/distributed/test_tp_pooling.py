"""A pooling model (a bare Qwen3Model, MEAN pooling) at TP=2: every rank runs the forward of each
prompt chunk (the hidden states, summed by the all-reduces, are whole on rank 0, which pools), and
the vectors equal TP=1's within 1e-5, under chunked prefill."""
from __future__ import annotations

import torch
from tiny_models import make_tiny_base_model

from appliance import LLM

PROMPTS = ["Paris is the capital of France.", "The quick brown fox jumps over the lazy dog. " * 3, "Hello"]


def test_tp2_embeddings_equal_tp1(tmp_path):
    path = make_tiny_base_model(tmp_path / "qwen3-base", "qwen3")
    kw = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, linear_backend="torch",
              pooler_config={"pooling_type": "MEAN", "normalize": False})
    want = [o.outputs.embedding for o in LLM(str(path), **kw).embed(PROMPTS)]
    two = LLM(str(path), tensor_parallel_size=2, **kw)
    try:
        assert two.engine.runner_type == "pooling" and two.engine.runner.world_size == 2
        got = [o.outputs.embedding for o in two.embed(PROMPTS)]
    finally:
        two.engine.runner.close()
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=1e-5, rtol=0)
