"""The decode graph runner on the CPU, with a stand-in for graph replay (a capture that returns the
forward itself, so "replay" runs it eagerly on the padded persistent buffers). Checks: every decode
batch is padded to the next captured size, real rows' hidden states equal the unpadded eager
forward's, and generation gives the same greedy tokens as without the runner."""
from __future__ import annotations

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.engine.cuda_graphs import DecodeGraphRunner, capture_sizes
from appliance.layers.forward_context import ForwardContext, set_forward_context
from cuda_device import DEVICE


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(256)[-2:] == [128, 256]
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


class CheckedGraphs(DecodeGraphRunner):
    """Runs each decode batch both ways and records (real rows, padded size, max |difference|)."""

    def __init__(self, *a, **kw):
        self.record: list[tuple[int, int, float]] = []
        super().__init__(*a, **kw)

    def run(self, input_ids, positions, md):
        got = super().run(input_ids, positions, md).clone()
        with set_forward_context(ForwardContext(md, self.kv_caches, self.ops)):  # rewrites the same K/V
            want = self.model(input_ids, positions)
        n = input_ids.shape[0]
        self.record.append((n, self.padded_size(n), (got - want).abs().max().item()))
        return got


PROMPTS = ["The quick brown fox", "Hello", "def f(x): return x * 2", "Paris is", "one two three"]


def generate(llm, ids):
    # distinct lengths: the decode batch shrinks 5, 4, 3, 2, 1 as requests finish
    params = [SamplingParams(temperature=0, max_tokens=2 + 2 * i, ignore_eos=True) for i in range(len(ids))]
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=params)]


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_padding_never_changes_real_rows(llama_dir, backend):
    if backend == "cuda":
        pytest.importorskip("triton", reason="triton is not installed (pip install -e .[test])")
    kw = dict(dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=8)
    plain = LLM(str(llama_dir), attention_backend="reference", **kw)
    ids = [plain.get_tokenizer().encode(p) for p in PROMPTS]
    want = generate(plain, ids)

    # the Triton op set on the GPU when there is one (enforce_eager: no real graphs, the stand-in's)
    llm = LLM(str(llama_dir), attention_backend=backend, device=DEVICE if backend == "cuda" else "cpu",
              enforce_eager=True, **kw)
    r = llm.engine.runner
    assert r.graphs is None  # enforce_eager, or a CPU engine: nothing captured
    r.graphs = CheckedGraphs(r.model, r.ops, r.kv_caches, 8, 64, r.device, capture=lambda fn: fn)
    assert r.graphs.sizes == [1, 2, 4, 8]
    assert generate(llm, ids) == want
    rec = r.graphs.record
    assert {(n, s) for n, s, _ in rec} >= {(5, 8), (4, 4), (3, 4), (2, 2), (1, 1)}
    assert max(d for _, _, d in rec) <= 1e-5, rec
    llm.engine.check_integrity()


def test_run_refuses_what_was_not_captured(llama_dir):
    llm = LLM(str(llama_dir), attention_backend="reference", dtype="float32", num_kv_blocks=16, block_size=4)
    r = llm.engine.runner
    g = DecodeGraphRunner(r.model, r.ops, r.kv_caches, 2, 4, r.device, capture=lambda fn: fn)
    from appliance.layers.forward_context import AttentionMetadata
    md = AttentionMetadata(torch.zeros(3, dtype=torch.int64), torch.zeros(3, 1, dtype=torch.int32),
                           torch.ones(3, dtype=torch.int32), torch.arange(4, dtype=torch.int32), 1, 1)
    with pytest.raises(ValueError, match="at most 2 sequences, got 3"):
        g.run(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), md)


def test_only_decode_batches_that_fit_are_replayed(llama_dir):
    # graphs up to 2 sequences in an engine of 8: larger decode batches and every prefill step run
    # eagerly, and the tokens do not change
    kw = dict(attention_backend="reference", dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=8)
    plain = LLM(str(llama_dir), **kw)
    ids = [plain.get_tokenizer().encode(p) for p in PROMPTS]
    want = generate(plain, ids)
    llm = LLM(str(llama_dir), **kw)
    r = llm.engine.runner
    r.graphs = CheckedGraphs(r.model, r.ops, r.kv_caches, 2, 64, r.device, capture=lambda fn: fn)
    assert generate(llm, ids) == want
    assert {n for n, _, _ in r.graphs.record} == {1, 2}  # 3, 4, 5-sequence decode steps went eager
