"""A query row's attention does not depend on the other query rows of its call: each row of a chunk
(a speculative verify of 1 + k tokens, a prefill chunk) equals, bit for bit, the one-query call at its
position (the decode step there). A key's score used to be summed over its lanes with one tree when the
call held 4 or more keys from it on and another in the last n % 4 (x86), so the chunk's earlier rows,
which see the chunk's later keys masked, differed in the last bits from their decode step; through a
quantized model's int8 activations that became another greedy token some tokens later."""
from __future__ import annotations

import pytest
import torch

from appliance.ops import native, reference

H, KVH, D, BS = 9, 3, 64, 16  # the default model's heads (GQA groups of 3) and head size


def _cache(dtype, nb, g):
    k = torch.randn(nb, KVH, BS, D, generator=g)
    v = torch.randn(nb, KVH, BS, D, generator=g)
    if dtype in (torch.float32, torch.bfloat16):
        return k.to(dtype), v.to(dtype), None, None
    (kc, ks), (vc, vs) = reference.quantize_kv(k, dtype), reference.quantize_kv(v, dtype)
    return kc, vc, ks, vs


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn],
                         ids=str)
def test_chunk_rows_equal_their_decode_steps(variant, cache_dtype):
    g = torch.Generator().manual_seed(3)
    for ctx0 in (1, 2, 3, 5, 13, 17, 30, 47, 130, 700):  # every remainder of a block's keys mod 4
        for q_len in (2, 4, 7):
            ctx = ctx0 + q_len
            nb = -(-ctx // BS)
            kc, vc, ks, vs = _cache(cache_dtype, nb, g)
            bt = torch.arange(nb, dtype=torch.int32)[None]
            qdt = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
            q = torch.randn(q_len, H, D, generator=g).to(qdt)
            chunk = native.paged_attention(q, kc, vc, bt, torch.tensor([ctx], dtype=torch.int32),
                                           torch.tensor([0, q_len], dtype=torch.int32), 0.125, q_len,
                                           k_scale=ks, v_scale=vs)
            for j in range(q_len):
                one = native.paged_attention(q[j:j + 1].contiguous(), kc, vc, bt,
                                             torch.tensor([ctx0 + j + 1], dtype=torch.int32),
                                             torch.tensor([0, 1], dtype=torch.int32), 0.125, 1,
                                             k_scale=ks, v_scale=vs)
                assert torch.equal(chunk[j], one[0]), (variant, cache_dtype, ctx0, q_len, j)
