"""paged_attention and reshape_and_cache: every variant against the torch reference.

Tolerances (max abs error, and relative to |reference|):
  * float32 query/output over a float32 or bf16 cache, fp32-math variants: 2e-5 + 2e-5*|ref|
    (the kernels sum in another order and use a polynomial exp with <3e-7 relative error);
  * variants that multiply in bf16 over a bf16 cache (avx512bf16: VDPBF16PS for Q.K^T;
    neon_bf16: BFMMLA for Q.K^T and P.V) round the query (and P) to bf16: 2e-2 + 2e-2*|ref|;
  * bf16 output: one bf16 ulp of the result on top, 2e-2 + 2e-2*|ref|.
"""
from __future__ import annotations

import pytest
import torch

from appliance.ops import native, reference

BF16_MATH_VARIANTS = {"avx512bf16", "neon_bf16"}


def make_case(seqs, num_heads, num_kv_heads, head_size, block_size, kv_dtype, q_dtype, seed=0):
    """seqs: list of (q_len, ctx). Returns query, caches, block_table, seq_lens, query_start_loc
    with the context in scattered, non-contiguous blocks and garbage everywhere else in the cache."""
    g = torch.Generator().manual_seed(seed)
    nbs = [(ctx + block_size - 1) // block_size for _, ctx in seqs]
    num_blocks = sum(nbs) + 7
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_nb = max(nbs)
    block_table = torch.full((len(seqs), max_nb + 2), -1, dtype=torch.int32)
    shape = reference.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    # Garbage (large, finite) wherever no context lives: a kernel reading past a sequence's end
    # or an unmasked position shows up as a large error.
    key_cache = torch.full(shape, 37.0).to(kv_dtype)
    value_cache = torch.full(shape, -53.0).to(kv_dtype)
    i = 0
    for s, (q_len, ctx) in enumerate(seqs):
        ids = perm[i:i + nbs[s]]
        i += nbs[s]
        block_table[s, :nbs[s]] = torch.tensor(ids, dtype=torch.int32)
        for b, blk in enumerate(ids):
            n = min(block_size, ctx - b * block_size)
            key_cache[blk, :, :n] = torch.randn(num_kv_heads, n, head_size, generator=g).to(kv_dtype)
            value_cache[blk, :, :n] = torch.randn(num_kv_heads, n, head_size, generator=g).to(kv_dtype)
    q_lens = [q for q, _ in seqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = (torch.randn(int(qsl[-1]), num_heads, head_size, generator=g) * 1.5).to(q_dtype)
    seq_lens = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    return query, key_cache, value_cache, block_table, seq_lens, qsl


def tolerance(variant, q_dtype, kv_dtype):
    if q_dtype == torch.bfloat16 or (kv_dtype == torch.bfloat16 and variant in BF16_MATH_VARIANTS):
        return 2e-2, 2e-2
    return 2e-5, 2e-5


def check(variant, seqs, num_heads, num_kv_heads, head_size, block_size=16,
          kv_dtype=torch.float32, q_dtype=torch.float32, seed=0):
    q, kc, vc, bt, sl, qsl = make_case(seqs, num_heads, num_kv_heads, head_size, block_size,
                                       kv_dtype, q_dtype, seed)
    scale = reference.softmax_scale(head_size)
    ref = reference.paged_attention(q, kc, vc, bt, sl, qsl, scale).float()
    out = native.paged_attention(q, kc, vc, bt, sl, qsl, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    atol, rtol = tolerance(variant, q_dtype, kv_dtype)
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


# --- decode (one query per sequence) ---------------------------------------------------------

@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("head_size", [64, 128])
def test_decode_gqa(variant, ratio, head_size):
    # 1 block, partial blocks, exactly full blocks, and contexts long enough to be partitioned.
    seqs = [(1, 1), (1, 17), (1, 48), (1, 100), (1, 700), (1, 1100)]
    check(variant, seqs, 2 * ratio, 2, head_size)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(3, 1), (12, 2), (10, 2), (128, 1)])
def test_odd_and_large_groups(variant, num_heads, num_kv_heads):
    # Groups of 3, 6 and 5 rows (odd row tails of the multi-row micro-kernels and of BFMMLA's
    # row pairs) and MQA with 128 query heads (more rows than one work tile holds).
    for kv_dtype in (torch.float32, torch.bfloat16):
        check(variant, [(1, 40), (1, 530), (9, 60), (70, 70)], num_heads, num_kv_heads, 64,
              kv_dtype=kv_dtype)


@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_decode_block_sizes(variant, block_size):
    check(variant, [(1, 3), (1, 33), (1, 530)], 8, 2, 64, block_size=block_size)


@pytest.mark.parametrize("head_size", [16, 48, 80, 256])
def test_decode_other_head_sizes(variant, head_size):
    check(variant, [(1, 9), (1, 77)], 4, 1, head_size)  # MQA as well


@pytest.mark.parametrize("kv_dtype,q_dtype", [
    (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_decode_dtypes(variant, kv_dtype, q_dtype, ratio):
    check(variant, [(1, 1), (1, 31), (1, 600)], 2 * ratio, 2, 64, kv_dtype=kv_dtype, q_dtype=q_dtype)


# --- prefill, chunked prefill, mixed batches --------------------------------------------------

@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_prefill(variant, ratio):
    # Whole prompts (q_len == ctx), longer than one query tile of the kernel.
    check(variant, [(1, 1), (13, 13), (70, 70), (150, 150)], 2 * ratio, 2, 64)


@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 7])
def test_chunked_prefill_mid_context(variant, ratio, block_size):
    # A chunk starting mid-block after cached context (a prefix-cache hit or a previous chunk).
    check(variant, [(37, 200), (5, 21), (64, 600), (3, 1030)], 2 * ratio, 2, 64, block_size=block_size)


@pytest.mark.parametrize("kv_dtype,q_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_mixed_batch(variant, kv_dtype, q_dtype):
    seqs = [(1, 250), (40, 40), (1, 7), (17, 600), (1, 1), (9, 130)]
    check(variant, seqs, 8, 2, 128, kv_dtype=kv_dtype, q_dtype=q_dtype, seed=3)


def test_strided_query_and_padded_block_table(variant):
    """A query that is a view (e.g. of a fused qkv projection) and a block table with unused
    (-1) columns and an int64 dtype."""
    q, kc, vc, bt, sl, qsl = make_case([(1, 40), (12, 90)], 8, 2, 64, 16, torch.float32, torch.float32)
    qkv = torch.cat([q, torch.randn_like(q)], dim=1)  # [T, 2H, D]
    qv = qkv[:, :8]
    scale = reference.softmax_scale(64)
    ref = reference.paged_attention(q, kc, vc, bt, sl, qsl, scale)
    out = native.paged_attention(qv, kc, vc, bt.long(), sl, qsl, scale)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_unsupported_head_size_falls_back_to_reference():
    q, kc, vc, bt, sl, qsl = make_case([(1, 20), (5, 30)], 4, 2, 40, 16, torch.float32, torch.float32)
    scale = reference.softmax_scale(40)
    ref = reference.paged_attention(q, kc, vc, bt, sl, qsl, scale)
    torch.testing.assert_close(native.paged_attention(q, kc, vc, bt, sl, qsl, scale), ref)
    qh = q.half()
    torch.testing.assert_close(
        native.paged_attention(qh, kc.half(), vc.half(), bt, sl, qsl, scale),
        reference.paged_attention(qh, kc.half(), vc.half(), bt, sl, qsl, scale))


# --- reshape_and_cache ------------------------------------------------------------------------

@pytest.mark.parametrize("in_dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_reshape_and_cache(variant, in_dtype, cache_dtype, block_size):
    g = torch.Generator().manual_seed(1)
    num_tokens, hkv, d, nblocks = 23, 2, 64, 9
    kv = torch.randn(num_tokens, 2 * hkv, d, generator=g).to(in_dtype)
    key, value = kv[:, :hkv], kv[:, hkv:]  # strided views, as split from a fused projection
    key[0, 0, 0] = float("nan")
    slots = torch.randperm(nblocks * block_size, generator=g)[:num_tokens]
    slots[[3, 11]] = -1  # padding tokens are skipped
    shape = reference.kv_cache_shape(nblocks, block_size, hkv, d)
    caches = [torch.full(shape, 7.0, dtype=cache_dtype) for _ in range(4)]
    reference.reshape_and_cache(key, value, caches[0], caches[1], slots)
    native.reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0].nan_to_num(), caches[2].nan_to_num())  # bit-exact, RNE rounding
    assert torch.equal(caches[1], caches[3])
    assert caches[2].isnan().sum() == 1


def test_reshape_then_attend_roundtrip(variant):
    """The engine's order: write this step's K/V by slot mapping, then attend over the cache."""
    g = torch.Generator().manual_seed(2)
    bs, hkv, h, d = 16, 2, 8, 64
    q, kc, vc, bt, sl, qsl = make_case([(1, 45), (20, 20)], h, hkv, d, bs, torch.float32, torch.float32)
    new_k = torch.randn(21, hkv, d, generator=g)
    new_v = torch.randn(21, hkv, d, generator=g)
    slots = []
    for s, (q_len, ctx) in enumerate([(1, 45), (20, 20)]):
        for pos in range(ctx - q_len, ctx):
            slots.append(int(bt[s, pos // bs]) * bs + pos % bs)
    slots = torch.tensor(slots)
    kc2, vc2 = kc.clone(), vc.clone()
    reference.reshape_and_cache(new_k, new_v, kc, vc, slots)
    native.reshape_and_cache(new_k, new_v, kc2, vc2, slots)
    scale = reference.softmax_scale(d)
    ref = reference.paged_attention(q, kc, vc, bt, sl, qsl, scale)
    torch.testing.assert_close(native.paged_attention(q, kc2, vc2, bt, sl, qsl, scale), ref,
                               atol=2e-5, rtol=2e-5)
