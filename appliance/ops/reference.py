"""Pure-torch reference implementations of every kernel: the oracle native kernels are held to.

KV cache layout (owned by the attention backend, see ``kv_cache_shape``): for one layer,
``key_cache`` and ``value_cache`` are each ``[num_blocks, num_kv_heads, block_size, head_size]``.
One block of one KV head is a contiguous ``block_size x head_size`` tile, which is what a CPU
kernel wants to stream through.

Batch layout for attention (vLLM's "varlen" convention): the step's tokens are packed, sequence
after sequence; ``query_start_loc[b]:query_start_loc[b+1]`` are sequence b's new tokens and
``seq_lens[b]`` its total context length *including* them, so query i of sequence b sits at
position ``seq_lens[b] - q_len_b + i`` and attends to positions ``0..that position`` (with a sliding
window W, only to the last W of them: see ``paged_attention``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """Shape of one layer's key (or value) cache."""
    return (num_blocks, num_kv_heads, block_size, head_size)


# --- Quantized KV cache (``--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2``) --------------------------
# Storage: the cache tensors hold one byte per element (torch.int8 / float8_e4m3fn / float8_e5m2), and
# each cached token's head row has its own float32 scale in a side tensor ``[num_blocks, num_kv_heads,
# block_size]`` (``kv_scale_shape``: the cache's paged layout minus head_size), so a block's scales
# travel with it (prefix caching, freeing) with no bookkeeping of their own. An element's value is
# ``code * scale``. Scale = absmax(row) / the type's largest finite value, symmetric, no zero point.
#
# Why per token and head, for fp8 too: vLLM's default fp8 KV uses one per-tensor scale of 1.0, and
# e4m3 tops out at 448, so any K or V entry beyond that (they reach thousands in some models' outlier
# channels) saturates; a per-row scale cannot overflow, spends e4m3's 3 mantissa bits on the row's own
# range, and costs 4 bytes per row (3% of a 128-wide row of bytes). Per-block scales were not chosen:
# a block's later tokens can raise its absmax after earlier ones are written, which would mean
# rescaling written codes (or a worse scale fixed by the first token).
KV_QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# the --kv-cache-dtype names (appliance.config.KV_CACHE_DTYPES) -> the cache tensors' dtype
KV_CACHE_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn,
                         "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for a ``--kv-cache-dtype`` name; ``auto`` is the model's dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_TORCH_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_TORCH_DTYPES)}; "
                         f"got {kv_cache_dtype!r}")
    return KV_CACHE_TORCH_DTYPES[kv_cache_dtype]


def kv_cache_is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype carries per-row scales."""
    return dtype in KV_QUANT_MAX


def kv_scale_shape(num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
    """Shape of one layer's key (or value) scales for a quantized cache: float32, one per cached row."""
    return (num_blocks, num_kv_heads, block_size)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., head_size]`` -> (codes ``[..., head_size]`` of ``dtype``, float32 scales ``[...]``):
    scale = absmax / max (1 for an all-zero row), codes of ``clamp(x / scale, -max, max)`` (int8:
    rounded half to even; fp8: torch's round-to-nearest-even conversion). Math in float32; the native
    writer produces the same bits."""
    qmax = KV_QUANT_MAX[dtype]
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / torch.tensor(qmax, dtype=torch.float32)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (xf / scale.unsqueeze(-1)).clamp_(-qmax, qmax)
    codes = y.round_().to(dtype) if dtype == torch.int8 else y.to(dtype)
    return codes, scale


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``codes * scale`` (``scale`` broadcast over the last dim): what attention reads."""
    return codes.float() * scale.unsqueeze(-1)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, slot = block_id * block_size + offset
    k_scale: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size] float32: quantized caches
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each token's K and V into its slot. Negative slots are skipped (padding). A quantized
    cache (int8 / fp8 dtype) gets codes and per-row scales (``quantize_kv``)."""
    block_size = key_cache.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    if kv_cache_is_quantized(key_cache.dtype):
        if k_scale is None or v_scale is None:
            raise ValueError(f"a {key_cache.dtype} KV cache needs k_scale and v_scale")
        kq, ks = quantize_kv(key, key_cache.dtype)
        vq, vs = quantize_kv(value, value_cache.dtype)
        key_cache[block_ids, :, offsets] = kq
        value_cache[block_ids, :, offsets] = vq
        k_scale[block_ids, :, offsets] = ks
        v_scale[block_ids, :, offsets] = vs
        return
    key_cache[block_ids, :, offsets] = key.to(key_cache.dtype)
    value_cache[block_ids, :, offsets] = value.to(value_cache.dtype)


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """[num_kv_heads, length, head_size] for one sequence, in position order."""
    blocks = cache.index_select(0, block_ids)  # [n, H, BS, D]
    n, h, bs, d = blocks.shape
    return blocks.permute(1, 0, 2, 3).reshape(h, n * bs, d)[:, :length]


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including this step's tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    max_query_len: int | None = None,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    k_scale: torch.Tensor | None = None,  # quantized caches: [num_blocks, num_kv_heads, block_size] float32
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context.

    The new tokens' K/V must already be in the cache (``reshape_and_cache`` first).
    ``sliding_window=W > 0``: the query at position p attends keys at positions ``p-W+1 .. p`` only
    (W keys, itself included), as transformers' sliding-window mask (``kv_idx > q_idx - W``).
    Blocks wholly before every window of a sequence are never read, so their ``block_table``
    entries may be placeholders (the engine frees such blocks).
    ``logits_soft_cap=c > 0``: scores (after ``* scale``) become ``c * tanh(scores / c)`` before the
    mask and softmax (Gemma 2's ``attn_logit_softcapping``). 0 turns either off.
    A quantized cache (int8 / fp8) is read as ``dequantize_kv(codes, scale)`` (float32).
    Returns ``[num_tokens, num_heads, head_size]`` in ``query``'s dtype. Math in float32.
    """
    if kv_cache_is_quantized(key_cache.dtype):
        if k_scale is None or v_scale is None:
            raise ValueError(f"a {key_cache.dtype} KV cache needs k_scale and v_scale")
        # the oracle: the whole cache dequantized once, then the float path below
        key_cache, value_cache = dequantize_kv(key_cache, k_scale), dequantize_kv(value_cache, v_scale)
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0: off), got {sliding_window}")
    if logits_soft_cap < 0:
        raise ValueError(f"logits_soft_cap must be >= 0 (0: off), got {logits_soft_cap}")
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    num_seqs = len(lens)
    q_lens = [qsl[i + 1] - qsl[i] for i in range(num_seqs)]
    if max_query_len is None:
        max_query_len = max(q_lens, default=0)

    def first_block(ctx: int, q_len: int) -> int:
        # the block holding the first key the sequence's first new query can see
        return max(0, ctx - q_len - sliding_window + 1) // block_size if sliding_window > 0 else 0

    def cap(scores: torch.Tensor) -> torch.Tensor:
        return scores.div_(logits_soft_cap).tanh_().mul_(logits_soft_cap) if logits_soft_cap > 0 else scores

    decode = [i for i in range(num_seqs) if q_lens[i] == 1]
    if max_query_len == 1 and decode:
        # All-decode batch: one padded, vectorized gather + two batched matmuls.
        max_len = max(lens)
        nb = (max_len + block_size - 1) // block_size
        lo = min(first_block(lens[i], 1) for i in range(num_seqs))
        bt = block_table[:, lo:nb].long()
        if sliding_window > 0:
            # a sequence's entries before its own first block may be placeholders: read its
            # first block there instead (masked below, and always a valid block id)
            first = torch.tensor([first_block(lens[i], 1) - lo for i in range(num_seqs)], device=bt.device)
            cols = torch.arange(nb - lo, device=bt.device)
            bt = torch.where(cols[None, :] < first[:, None], bt.gather(1, first[:, None]), bt)
        n = (nb - lo) * block_size
        k = key_cache[bt].permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, n, head_size)
        v = value_cache[bt].permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, n, head_size)
        q = query[qsl[0]:qsl[-1]].float().view(num_seqs, num_kv_heads, group, head_size)
        scores = cap(torch.matmul(q, k.float().transpose(-1, -2)) * scale)  # [B, Hkv, G, L]
        pos = torch.arange(lo * block_size, nb * block_size, device=query.device)
        lens_t = seq_lens.to(query.device).long()[:, None]
        mask = pos[None, :] >= lens_t  # [B, L]
        if sliding_window > 0:
            mask |= pos[None, :] < lens_t - sliding_window
        scores.masked_fill_(mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, v.float())  # [B, Hkv, G, D]
        out[qsl[0]:qsl[-1]] = o.reshape(num_seqs, num_heads, head_size).to(query.dtype)
        return out

    for i in range(num_seqs):
        q_len, ctx = q_lens[i], lens[i]
        if q_len == 0:
            continue
        nb = (ctx + block_size - 1) // block_size
        fb = first_block(ctx, q_len)
        start = fb * block_size
        ids = block_table[i, fb:nb].long()
        k = _gather_context(key_cache, ids, ctx - start).float()  # [Hkv, ctx - start, D]
        v = _gather_context(value_cache, ids, ctx - start).float()
        q = query[qsl[i]:qsl[i + 1]].float().permute(1, 0, 2)  # [H, q_len, D]
        q = q.reshape(num_kv_heads, group * q_len, head_size)
        scores = cap(torch.matmul(q, k.transpose(-1, -2)) * scale)  # [Hkv, G*q_len, ctx - start]
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device).repeat(group)
        k_pos = torch.arange(start, ctx, device=query.device)
        mask = k_pos[None, :] > q_pos[:, None]
        if sliding_window > 0:
            mask |= k_pos[None, :] <= q_pos[:, None] - sliding_window
        scores.masked_fill_(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, v).view(num_heads, q_len, head_size).permute(1, 0, 2)
        out[qsl[i]:qsl[i + 1]] = o.to(query.dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim; math in float32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x; return rms_norm(residual), residual``. Updates ``residual`` in place."""
    residual.add_(x)
    return rms_norm(residual, weight, eps), residual


def rotary_cos_sin_cache(inv_freq: torch.Tensor, max_position: int, dtype=torch.float32) -> torch.Tensor:
    """``[max_position, rotary_dim]``: cos in the first half, sin in the second."""
    t = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``rotary_dim`` dims of q and k. neox: halves; gptj: interleaved pairs."""
    rotary_dim = cos_sin_cache.shape[-1]
    cs = cos_sin_cache.index_select(0, positions.long())
    cos, sin = cs.chunk(2, dim=-1)  # [T, rotary_dim/2]
    cos, sin = cos[:, None, :].float(), sin[:, None, :].float()

    def rot(x: torch.Tensor) -> torch.Tensor:
        xr, xp = x[..., :rotary_dim].float(), x[..., rotary_dim:]
        if is_neox:
            x1, x2 = xr.chunk(2, dim=-1)
            o = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            o = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([o.to(x.dtype), xp], dim=-1) if xp.shape[-1] else o.to(x.dtype)

    return rot(query), rot(key)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` where the last dim is ``2d``."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """``gelu(x[..., :d]) * x[..., d:]`` (GeGLU) where the last dim is ``2d``; ``approximate``:
    ``tanh`` (Gemma's ``gelu_pytorch_tanh``) or ``none`` (the exact erf GELU)."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate=approximate) * x[..., d:]


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum along the last dim (a NaN counts as the maximum), int64."""
    return x.argmax(dim=-1)


def softmax_scale(head_size: int) -> float:
    return 1.0 / math.sqrt(head_size)
