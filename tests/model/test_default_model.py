"""The embedded default model (SmolLM2-135M-Instruct from its GGUF) through the engine."""
from __future__ import annotations

import pytest
import torch
import transformers
from helpers import engine_logits

from appliance import LLM, SamplingParams
from appliance.models.default_model import default_gguf_path


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=2048, kv_cache_memory=0.25)


def test_answers_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


def test_logits_match_transformers_gguf_loading(llm):
    path = default_gguf_path()
    with pytest.MonkeyPatch.context() as mp:
        # transformers refuses gguf_file without accelerate installed, though with device_map=None
        # nothing on this path uses it; accelerate is no dependency of ours.
        mp.setattr(transformers.modeling_utils, "is_accelerate_available", lambda: True)
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    for prompt in ["The capital of France is", "def fibonacci(n):\n    "]:
        ids = tok.encode(prompt)
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(engine_logits(llm, ids), want, atol=1e-4, rtol=0)


def test_native_kernels_match_reference_path_greedy(llm):
    """Whole-model greedy output of the default model: native kernels == the torch reference ops."""
    ref = LLM(dtype="float32", max_model_len=2048, kv_cache_memory=0.25, attention_backend="reference")
    assert llm.engine.runner.ops.__name__.endswith("native")
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away,"]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, sp)]
    assert got == want
