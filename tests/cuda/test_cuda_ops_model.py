"""Tiny models generating through the CUDA op set (Triton attention and cache writes, torch
elementwise) give the reference op set's greedy tokens and transformers' too. On the CPU the kernels
run under the Triton interpreter, so prompts and outputs are short; on a GPU the same tests run on
the device. Batches mix prefill, chunked prefill (a 12-token step budget splits the long prompt) and
decode; Gemma 2 adds a sliding window shorter than the prompts and a logit soft-cap."""
from __future__ import annotations

import pytest

from appliance import LLM, SamplingParams
from cuda_device import DEVICE
from helpers import hf_greedy

pytest.importorskip("triton", reason="triton is not installed (pip install -e .[test])")

PROMPTS = ["The quick brown fox jumps over the lazy dog; Paris is the capital of France", "Hello", "def f(x): return x"]
MAX_NEW = 6
CASES = {
    "llama_gqa": ("llama", False, 2, {}),
    "qwen3_head16": ("qwen3", False, 2, {}),
    "gemma2_window_softcap": ("gemma2", False, 2, dict(sliding_window=5, attn_logit_softcapping=1.5)),
}


def greedy(path, backend, ids, device="cpu"):
    llm = LLM(str(path), dtype="float32", attention_backend=backend, num_kv_blocks=32, block_size=4,
              max_num_batched_tokens=12, device=device)
    outs = llm.generate(prompt_token_ids=ids,
                        sampling_params=SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    llm.engine.check_integrity()
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_reference_ops(tiny_model_dir, case):
    arch, tie, kv, kw = CASES[case]
    path = tiny_model_dir(arch, tie, kv, **kw)
    ref_llm = LLM(str(path), dtype="float32", attention_backend="reference", num_kv_blocks=32, block_size=4,
                  max_num_batched_tokens=12)
    ids = [ref_llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert max(map(len, ids)) > 12  # the long prompt is prefilled in chunks
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(
        prompt_token_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))]
    got, llm = greedy(path, "cuda", ids, DEVICE)
    assert llm.engine.runner.ops.__name__ == "appliance.ops.cuda_ops"
    assert got == ref
    _, hf = hf_greedy(path, ids, MAX_NEW)
    assert got == hf
