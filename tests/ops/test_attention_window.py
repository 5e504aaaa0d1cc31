"""Sliding-window attention and attention-logit soft-capping in paged_attention, reference and every
native variant, against a dense float64 reference computed from the sequences' own K/V.

Window semantics (transformers' sliding-window mask, ``kv_idx > q_idx - W``): the query at position
p attends keys p-W+1 .. p. Blocks wholly before a sequence's first window hold NaN and their
block-table entries point at them: a kernel that reads one (even masked) returns NaN.
Tolerances: the reference 1e-5 (float32 math, float64 oracle); native variants as
tests/ops/test_attention.py (2e-5 + 2e-5*|ref| in float32, 2e-2 where bf16 is involved).
"""
from __future__ import annotations

import math

import pytest
import torch

from appliance.ops import native, reference

BF16_MATH_VARIANTS = {"avx512bf16", "neon_bf16"}


def first_block(ctx: int, q_len: int, window: int, block_size: int) -> int:
    return max(0, ctx - q_len - window + 1) // block_size if window else 0


def make_case(seqs, num_heads, num_kv_heads, head_size, block_size, window, kv_dtype=torch.float32,
              q_dtype=torch.float32, seed=0):
    """seqs: (q_len, ctx) pairs. Returns the paged inputs and each sequence's dense float64 K, V."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = sum(nbs) + 3
    nan_block = num_blocks // 2  # not the last block: -1 padding must stay finite garbage
    free = [b for b in torch.randperm(num_blocks, generator=g).tolist() if b != nan_block]
    shape = reference.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.full(shape, 37.0).to(kv_dtype)
    value_cache = torch.full(shape, -53.0).to(kv_dtype)
    key_cache[nan_block] = float("nan")
    value_cache[nan_block] = float("nan")
    block_table = torch.full((len(seqs), max(nbs) + 2), -1, dtype=torch.int32)
    dense = []
    for s, (q_len, ctx) in enumerate(seqs):
        k = torch.randn(num_kv_heads, ctx, head_size, generator=g).to(kv_dtype)
        v = torch.randn(num_kv_heads, ctx, head_size, generator=g).to(kv_dtype)
        dense.append((k.double(), v.double()))
        fb = first_block(ctx, q_len, window, block_size)
        for b in range(nbs[s]):
            if b < fb:  # out of every window of this step: a placeholder the kernels must not read
                block_table[s, b] = nan_block
                continue
            blk = free.pop()
            block_table[s, b] = blk
            n = min(block_size, ctx - b * block_size)
            key_cache[blk, :, :n] = k[:, b * block_size:b * block_size + n]
            value_cache[blk, :, :n] = v[:, b * block_size:b * block_size + n]
    q_lens = [q for q, _ in seqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = (torch.randn(int(qsl[-1]), num_heads, head_size, generator=g) * 1.5).to(q_dtype)
    seq_lens = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    return (query, key_cache, value_cache, block_table, seq_lens, qsl), dense


def dense_reference(query, dense, seqs, scale, window, soft_cap):
    """float64, one sequence at a time over its whole dense context, masks straight from the definition."""
    num_heads = query.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    t = 0
    for (q_len, ctx), (k, v) in zip(seqs, dense):
        group = num_heads // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [H, ctx, D]
        q = query[t:t + q_len].double().transpose(0, 1)  # [H, q_len, D]
        s = q @ k.transpose(1, 2) * scale  # [H, q_len, ctx]
        if soft_cap:
            s = soft_cap * torch.tanh(s / soft_cap)
        p = torch.arange(ctx - q_len, ctx)[:, None]  # query positions
        j = torch.arange(ctx)[None, :]  # key positions
        visible = (j <= p) & ((j > p - window) if window else True)
        s = s.masked_fill(~visible, float("-inf"))
        out[t:t + q_len] = (torch.softmax(s, -1) @ v).transpose(0, 1)
        t += q_len
    return out


def run(op, args, window, soft_cap):
    return op(*args, reference.softmax_scale(args[0].shape[-1]), None, sliding_window=window,
              logits_soft_cap=soft_cap)


DECODE = [(1, 1), (1, 17), (1, 48), (1, 100), (1, 700), (1, 1100)]  # 1100: partitioned contexts
CHUNKED = [(37, 200), (5, 21), (64, 600), (3, 1030), (70, 70), (1, 9)]  # prefill chunks after context


@pytest.mark.parametrize("window,soft_cap", [(1, 0.0), (8, 0.0), (16, 0.0), (100, 0.0), (4096, 0.0),
                                             (0, 5.0), (24, 5.0)])
@pytest.mark.parametrize("seqs", [DECODE, CHUNKED], ids=["decode", "chunked"])
def test_reference_against_dense_float64(seqs, window, soft_cap):
    args, dense = make_case(seqs, 8, 2, 32, 16, window)
    want = dense_reference(args[0], dense, seqs, reference.softmax_scale(32), window, soft_cap)
    got = run(reference.paged_attention, args, window, soft_cap)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_window_and_soft_cap_change_the_result():
    """Guards the tests above against a case where the window or the cap would not matter."""
    args, _ = make_case(CHUNKED, 8, 2, 32, 16, 0)
    full = run(reference.paged_attention, args, 0, 0.0)
    assert (run(reference.paged_attention, args, 24, 0.0) - full).abs().max() > 0.1
    assert (run(reference.paged_attention, args, 0, 5.0) - full).abs().max() > 0.1


def check_native(variant, seqs, num_heads, num_kv_heads, head_size, block_size, window, soft_cap,
                 kv_dtype=torch.float32, q_dtype=torch.float32, seed=0):
    args, dense = make_case(seqs, num_heads, num_kv_heads, head_size, block_size, window, kv_dtype,
                            q_dtype, seed)
    want = dense_reference(args[0], dense, seqs, reference.softmax_scale(head_size), window, soft_cap)
    got = run(native.paged_attention, args, window, soft_cap)
    assert got.dtype == q_dtype and got.shape == args[0].shape
    bf16 = q_dtype == torch.bfloat16 or (kv_dtype == torch.bfloat16 and variant in BF16_MATH_VARIANTS)
    tol = 2e-2 if bf16 else 2e-5
    if bf16:  # the oracle from the bf16-rounded query, as the kernels see it
        want = dense_reference(args[0].float(), dense, seqs, reference.softmax_scale(head_size), window, soft_cap)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("window", [1, 16, 100, 300])
def test_native_decode_window(variant, ratio, window):
    check_native(variant, DECODE, 2 * ratio, 2, 64, 16, window, 0.0)


@pytest.mark.parametrize("block_size", [16, 7])
@pytest.mark.parametrize("window", [5, 33, 512])
def test_native_chunked_prefill_window(variant, block_size, window):
    check_native(variant, CHUNKED, 8, 2, 64, block_size, window, 0.0)


@pytest.mark.parametrize("window", [0, 24])
def test_native_soft_cap(variant, window):
    check_native(variant, DECODE + CHUNKED, 8, 2, 64, 16, window, 5.0)


@pytest.mark.parametrize("kv_dtype,q_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_native_window_bf16(variant, kv_dtype, q_dtype):
    check_native(variant, DECODE[:4] + CHUNKED[:3], 8, 2, 64, 16, 40, 30.0, kv_dtype, q_dtype, seed=2)


def test_bad_arguments_are_refused():
    args, _ = make_case([(1, 4)], 2, 1, 16, 16, 0)
    with pytest.raises(ValueError, match="sliding_window must be >= 0"):
        run(reference.paged_attention, args, -1, 0.0)
    with pytest.raises(ValueError, match="logits_soft_cap must be >= 0"):
        run(reference.paged_attention, args, 0, -math.inf)


@pytest.mark.parametrize("ops_name", ["reference", "native"])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, None), (None, 3.0), (5, 3.0)])
def test_attention_layer_prefill_honours_window_and_cap(ops_name, window, soft_cap):
    """The layer's prefill-from-scratch path (SDPA under the reference ops) knows neither a window nor
    a cap: with either set the layer must attend through paged_attention, and match the oracle."""
    from appliance.layers.attention import Attention
    from appliance.layers.forward_context import AttentionMetadata, ForwardContext, set_forward_context

    ops = {"reference": reference, "native": native}[ops_name]
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, d, bs = 4, 2, 16, 4
    lens = [20, 13]
    q = torch.randn(sum(lens), heads, d, generator=g) * 1.5
    k = torch.randn(sum(lens), kv_heads, d, generator=g)
    v = torch.randn(sum(lens), kv_heads, d, generator=g)
    nbs = [-(-n // bs) for n in lens]
    table = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, -1]], dtype=torch.int32)
    slots = torch.cat([table[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for i, n in enumerate(lens)])
    shape = reference.kv_cache_shape(sum(nbs), bs, kv_heads, d)
    caches = [(torch.zeros(shape), torch.zeros(shape))]
    md = AttentionMetadata(slot_mapping=slots, block_table=table, seq_lens=torch.tensor(lens, dtype=torch.int32),
                           query_start_loc=torch.tensor([0, 20, 33], dtype=torch.int32), max_query_len=20,
                           max_seq_len=20, is_prefill_only=True)
    scale = d ** -0.5
    layer = Attention(heads, kv_heads, d, scale, 0, sliding_window=window, logits_soft_cap=soft_cap)
    with set_forward_context(ForwardContext(md, caches, ops)):
        got = layer(q, k, v).view(-1, heads, d)
    dense = [(k[:20].transpose(0, 1).double(), v[:20].transpose(0, 1).double()),
             (k[20:].transpose(0, 1).double(), v[20:].transpose(0, 1).double())]
    want = dense_reference(q, dense, [(20, 20), (13, 13)], scale, window or 0, soft_cap or 0.0)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
