"""The Triton cache-write and paged-attention kernels against appliance.ops.reference (the oracle)
on random paged batches: GQA with odd head counts, head sizes 16/64/128/256, block sizes that do and
do not divide the lengths, decode, prefill, chunked prefill, zero-length sequences, padded query
rows, sliding windows and logit soft-caps in one batch layout.

Blocks a sequence never reads (before its first sliding window) hold NaN and the block table points
at them, so a kernel that dereferences one fails. Tolerances: float32 1e-5, float16 1e-3 (absolute,
plus one rounding of the result to the output dtype (relative 2^-10 in float16, 2^-7 in bfloat16: the
oracle and the kernel each round a float32 result once, so they may land one ulp apart); bfloat16
2e-2 and GPU only (the Triton interpreter has no bf16 dot).
"""
from __future__ import annotations

import pytest
import torch

from appliance.ops import reference
from cuda_device import DEVICE

pytest.importorskip("triton", reason="triton is not installed (pip install -e .[test])")
from appliance.ops import triton_kernels as tk  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2}
ULP = {torch.float32: 0.0, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def dtype_param(dtype):
    if dtype is torch.bfloat16 and DEVICE == "cpu":
        return pytest.param(dtype, marks=pytest.mark.skip(reason="the Triton interpreter has no bf16 dot: GPU only"))
    return dtype


DTYPES = [dtype_param(d) for d in (torch.float32, torch.float16, torch.bfloat16)]


def make_batch(seqs, num_heads, num_kv_heads, head_size, block_size, dtype, window=0, pad_rows=0, seed=0):
    """seqs: (q_len, ctx) pairs. K/V of every context position written by the reference cache write;
    returns the attention arguments."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = sum(nbs) + 2
    nan_block = 0  # not the last: the reference's decode path reads block -1 for padding entries
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    shape = reference.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.full(shape, 37.0, dtype=dtype)
    value_cache = torch.full(shape, -53.0, dtype=dtype)
    key_cache[nan_block] = float("nan")
    value_cache[nan_block] = float("nan")
    block_table = torch.full((len(seqs), max(nbs, default=0) + 1), -1, dtype=torch.int32)
    for s, (q_len, ctx) in enumerate(seqs):
        fb = max(0, ctx - q_len - window + 1) // block_size if window else 0
        slots = []
        for b in range(nbs[s]):
            blk = nan_block if b < fb else free.pop()
            block_table[s, b] = blk
            slots += [blk * block_size + o for o in range(min(block_size, ctx - b * block_size))]
        slots = torch.tensor(slots, dtype=torch.int64)
        keep = slots // block_size != nan_block
        k = torch.randn(ctx, num_kv_heads, head_size, generator=g).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_size, generator=g).to(dtype)
        reference.reshape_and_cache(k[keep], v[keep], key_cache, value_cache, slots[keep])
    q_lens = [q for q, _ in seqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(int(qsl[-1]) + pad_rows, num_heads, head_size, generator=g).to(dtype)
    seq_lens = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    args = (query, key_cache, value_cache, block_table, seq_lens, qsl)
    return tuple(t.to(DEVICE) for t in args)


def check(seqs, num_heads, num_kv_heads, head_size, block_size, dtype, window=0, soft_cap=0.0, pad_rows=0, seed=0):
    args = make_batch(seqs, num_heads, num_kv_heads, head_size, block_size, dtype, window, pad_rows, seed)
    scale = head_size ** -0.5
    kw = dict(sliding_window=window, logits_soft_cap=soft_cap)
    cpu = tuple(t.cpu() for t in args)
    want = reference.paged_attention(*cpu, scale, **kw)
    got = tk.paged_attention(*args, scale, max_query_len=max((q for q, _ in seqs), default=0), **kw).cpu()
    n = int(cpu[5][-1])  # rows past the last sequence are padding: unwritten by both
    assert torch.isfinite(got[:n].float()).all()
    if n:
        got, want = got[:n].float(), want[:n].float()
        excess = ((got - want).abs() - TOL[dtype] - ULP[dtype] * want.abs()).max().item()
        assert excess <= 0, f"error exceeds {TOL[dtype]} + {ULP[dtype]}*|ref| by {excess}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads,block_size", [
    (16, 6, 2, 5),  # group 3, blocks that split every length unevenly
    (64, 7, 7, 16),  # MHA, odd head count
    (128, 3, 1, 8),  # group 3 over one KV head
    (256, 4, 2, 16),
])
def test_mixed_batch(dtype, head_size, num_heads, num_kv_heads, block_size):
    # chunked prefill (3 of 21), a zero-length sequence, decode, full prefill, decode at a block edge;
    # two padded query rows at the end
    seqs = [(3, 21), (0, 9), (1, 17), (12, 12), (1, block_size)]
    check(seqs, num_heads, num_kv_heads, head_size, block_size, dtype, pad_rows=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_only_gqa(dtype):
    check([(1, 1), (1, 33), (1, 16), (1, 40)], 8, 1, 64, 16, dtype, seed=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_prefill_spans_tiles(dtype):
    # more query tokens than one tile holds (64 rows / group 2 = 32 tokens), prefix already cached
    check([(45, 50), (33, 33)], 4, 2, 16, 16, dtype, seed=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,soft_cap", [(4, 0.0), (0, 5.0), (7, 30.0)])
def test_sliding_window_and_soft_cap(dtype, window, soft_cap):
    # windows shorter than a block and than the chunk; placeholder blocks before the windows hold NaN
    check([(1, 30), (5, 26), (20, 20), (0, 11)], 4, 2, 16, 4, dtype, window=window, soft_cap=soft_cap, seed=3)


def test_empty_batch_and_all_zero_lengths(device):
    q = torch.randn(3, 2, 16, device=device)
    cache = torch.zeros(reference.kv_cache_shape(2, 4, 1, 16), device=device)
    bt = torch.zeros(2, 1, dtype=torch.int32, device=device)
    qsl = torch.zeros(3, dtype=torch.int32, device=device)
    out = tk.paged_attention(q, cache, cache, bt, torch.tensor([0, 4], dtype=torch.int32, device=device), qsl, 0.25)
    assert out.shape == q.shape


def test_rejects_bad_window_and_cap(device):
    args = make_batch([(1, 3)], 2, 1, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="sliding_window"):
        tk.paged_attention(*args, 0.25, sliding_window=-1)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        tk.paged_attention(*args, 0.25, logits_soft_cap=-2.0)


@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.float16),
])
@pytest.mark.parametrize("num_kv_heads,head_size,block_size", [(3, 16, 5), (2, 128, 16), (1, 256, 8)])
def test_reshape_and_cache(dtype, cache_dtype, num_kv_heads, head_size, block_size):
    g = torch.Generator().manual_seed(4)
    num_tokens, num_blocks = 11, 4
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=g).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens: skipped
    shape = reference.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    want_k, want_v = torch.randn(shape, generator=g).to(cache_dtype), torch.randn(shape, generator=g).to(cache_dtype)
    got_k, got_v = want_k.clone().to(DEVICE), want_v.clone().to(DEVICE)
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    tk.reshape_and_cache(key.to(DEVICE), value.to(DEVICE), got_k, got_v, slots.to(DEVICE))
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)


def test_reshape_and_cache_strided_key(device):
    # K and V as views into one fused qkv projection output (the layers' layout)
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(6, 4 + 2 + 2, 16, generator=g)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([3, 0, -1, 9, 12, 5])
    shape = reference.kv_cache_shape(4, 4, 2, 16)
    want_k, want_v = torch.zeros(shape), torch.zeros(shape)
    got_k, got_v = want_k.clone().to(device), want_v.clone().to(device)
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    tk.reshape_and_cache(key.to(device), value.to(device), got_k, got_v, slots.to(device))
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)
