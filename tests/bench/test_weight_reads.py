"""bench_families' weights-read column: every linear layer's packed bytes, but of a mixture-of-experts
layer's experts only those its router chose in the step (per step, by token count)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from appliance.layers.linear import LinearBase
from appliance.models.moe import MoeConfig, MoeForCausalLM, ARCHS


def _bench_families():
    path = Path(__file__).resolve().parents[2] / "bench" / "bench_families.py"
    spec = importlib.util.spec_from_file_location("bench_families", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_weight_reads_count_the_chosen_experts_per_step():
    hf = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48,
              moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
              max_position_embeddings=64)
    model = MoeForCausalLM(MoeConfig.from_hf(hf, ARCHS["Qwen3MoeForCausalLM"], "Qwen3MoeForCausalLM"))
    for p in model.parameters():
        p.data.normal_(0, 0.5)
    reads = _bench_families().WeightReads(model)
    blocks = [layer.mlp for layer in model.model.layers]
    expert_bytes = sum(int(m.weight_bytes()) for m in blocks[0].experts[0].modules() if isinstance(m, LinearBase))
    all_bytes = sum(int(m.weight_bytes()) for m in model.modules() if isinstance(m, LinearBase))
    fixed = all_bytes - 2 * 8 * expert_bytes
    assert reads.fixed == fixed
    x1, x4 = torch.randn(1, 32), torch.randn(4, 32)
    chosen = {}
    for n, x in ((1, x1), (4, x4)):
        for i, b in enumerate(blocks):
            chosen[n, i] = len(b.gate(x)[2].unique())
    assert all(chosen[1, i] == 2 for i in range(2))  # one token: top-2, distinct experts
    for n in (1, 4):
        want = fixed + expert_bytes * (chosen[n, 0] + chosen[n, 1])  # the mean over the 2 layers, times 2
        assert abs(reads.mb_per_step(n) * 1e6 - want) < 1e-3 * want
    assert reads.mb_per_step(3) == fixed / 1e6  # no step of 3 tokens seen: no experts counted
