"""Triton kernels for the CUDA op set (``appliance.ops.cuda_ops``): the paged-KV cache write and one
paged-attention kernel for prefill, chunked prefill and decode alike.

Same contracts and layouts as ``appliance.ops.reference`` (the oracle): caches are
``[num_blocks, num_kv_heads, block_size, head_size]``, the batch is vLLM's varlen layout
(``query_start_loc``/``seq_lens``), query ``i`` of a sequence sits at ``seq_len - q_len + i``.

Only Triton APIs present in both 3.6 (the GPU machine) and 3.9 (the CPU wheel) are used. On the CPU
these kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, which must be set before
this module is imported: ``triton.jit`` picks interpreter or compiler when it decorates).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kch, stride_kco, stride_vcb, stride_vch, stride_vco,
    num_kv_heads, head_size, block_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per token: all its KV heads in one [BLOCK_H, BLOCK_D] tile
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # negative slot: a padding token, nothing to write
        blk = slot // block_size
        off = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < head_size)
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(key_cache_ptr + blk * stride_kcb + h * stride_kch + off * stride_kco + d,
                 k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + blk * stride_vcb + h * stride_vch + off * stride_vco + d,
                 v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens], negative = skip
) -> None:
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"reshape_and_cache: {name} must be contiguous in head_size, got strides {t.stride()}")
    block_size = key_cache.shape[2]
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        num_kv_heads, head_size, block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_size),
    )


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kh, stride_ko, stride_vb, stride_vh, stride_vo, stride_bt,
    scale, soft_cap, head_size, block_size, sliding_window,
    GROUP: tl.constexpr,  # query heads per KV head
    TOKENS: tl.constexpr,  # query tokens per tile; a tile's rows are (token, head-in-group) pairs
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # grid: (sequence, query tile, KV head). Packing a KV head's GROUP query heads into the rows
    # reads each K/V tile once per KV head instead of once per query head (GQA decode is bound by
    # exactly those reads).
    b = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    ctx = tl.load(seq_lens_ptr + b)
    tok0 = tile * TOKENS
    if tok0 < q_len:
        rows = tl.arange(0, BLOCK_M)
        tok = tok0 + rows // GROUP
        head = kvh * GROUP + rows % GROUP
        row_ok = (rows < TOKENS * GROUP) & (tok < q_len)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_size
        q_off = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        q_pos = ctx - q_len + tok  # each row's own position

        # keys this tile can see: up to its last row's position, from its first row's window start
        last_tok = tl.minimum(q_len, tok0 + TOKENS) - 1
        hi = ctx - q_len + last_tok + 1
        lo = tl.where(sliding_window > 0, tl.maximum(0, ctx - q_len + tok0 - sliding_window + 1), 0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        n = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            k_pos = start + n
            k_ok = k_pos < hi
            # positions -> (block id, offset); block_table is only read for positions in [lo, hi),
            # so placeholder entries before a sliding window are never dereferenced
            blk = tl.load(block_table_ptr + b * stride_bt + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
            off = k_pos % block_size
            kv_ok = k_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + blk[:, None] * stride_kb + kvh * stride_kh + off[:, None] * stride_ko
                        + d[None, :], mask=kv_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
            if USE_SOFT_CAP:
                # c * tanh(s / c), tanh written with sigmoid (present in every Triton version)
                s = soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0)
            visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if sliding_window > 0:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen nothing yet keeps -inf: subtract 0 there so exp gives 0, not NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + blk[:, None] * stride_vb + kvh * stride_vh + off[:, None] * stride_vo
                        + d[None, :], mask=kv_ok, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    max_query_len: int | None = None,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
) -> torch.Tensor:
    """``reference.paged_attention``'s contract on one Triton kernel. Rows of ``query`` past
    ``query_start_loc[-1]`` (padding) are left unwritten, as in the reference."""
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0: off), got {sliding_window}")
    if logits_soft_cap < 0:
        raise ValueError(f"logits_soft_cap must be >= 0 (0: off), got {logits_soft_cap}")
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if query.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("paged_attention: query and caches must be contiguous in head_size")
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        # a host sync; the engine passes max_query_len so CUDA graphs never hit this
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len == 0:
        return out
    # rows of a tile: decode needs only `group`; prefill tiles take 64 rows of (token, head) pairs
    block_m = max(16, triton.next_power_of_2(group if max_query_len == 1 else max(64, group)))
    tokens = max(1, block_m // group)
    block_d = max(16, triton.next_power_of_2(head_size))
    block_n = 32 if block_d <= 128 else 16  # keeps the K/V tiles of head size 256 in registers
    fp32 = query.dtype == torch.float32
    grid = (num_seqs, triton.cdiv(max_query_len, tokens), num_kv_heads)
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, out, block_table, seq_lens, query_start_loc,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_table.stride(0),
        float(scale), float(logits_soft_cap), head_size, block_size, int(sliding_window),
        GROUP=group, TOKENS=tokens, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        USE_SOFT_CAP=logits_soft_cap > 0,
        # fp32 must not silently drop to TF32 on the GPU: the reference tolerance is 1e-5
        DOT_PRECISION="ieee" if fp32 else None,
        # a 64 x 256 float32 accumulator is 64 KiB of registers: spread it over 8 warps
        num_warps=8 if block_d >= 256 else 4,
    )
    return out
