"""Quantized KV cache (--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2): the write (codes + per-row
float32 scales) and paged attention over such caches, reference and every native variant.

Oracles and tolerances:
  * codes: exactly the nearest code (exhaustive search over the format's finite codes in float64,
    ties to the even code) of the float32 quotient ``clamp(x / scale)``; scales exactly
    ``float32(absmax / max)`` (1 where that is 0: an all-zero row, or an underflow); and the dequantized value within half a code
    step of x (float64), the worst case of round-to-nearest;
  * native writes: bit for bit the reference's (codes and scales), every variant;
  * native attention over a quantized cache vs the reference over the same cache (which dequantizes
    it as ``codes * scale`` in float32 and runs the float path): 2e-5 + 2e-5*|ref|, as the float
    caches' tolerance in test_attention.py (same values, another summation order, polynomial exp).
"""
from __future__ import annotations

import math

import pytest
import torch

from appliance.ops import native, reference

QDTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
IDS = ["int8", "fp8_e4m3", "fp8_e5m2"]


def code_table(dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite code of the format (as its storage bytes) and its value in float64, from the
    format's definition (sign, exponent, mantissa), not from torch's conversion."""
    codes, vals = [], []
    for b in range(256):
        if dtype == torch.int8:
            codes.append(b)
            vals.append(float(b - 256 if b > 127 else b))
            continue
        mb, bias = (3, 7) if dtype == torch.float8_e4m3fn else (2, 15)
        m = b & 0x7F
        e, f = m >> mb, m & ((1 << mb) - 1)
        if (dtype == torch.float8_e4m3fn and m == 0x7F) or (dtype == torch.float8_e5m2 and e == 31):
            continue  # NaN / inf
        v = math.ldexp(f, 1 - bias - mb) if e == 0 else math.ldexp((1 << mb) + f, e - bias - mb)
        codes.append(b)
        vals.append(-v if b & 0x80 else v)
    return torch.tensor(codes, dtype=torch.int64), torch.tensor(vals, dtype=torch.float64)


def nearest_codes(y: torch.Tensor, dtype) -> torch.Tensor:
    """The oracle: the storage byte of the code nearest to each float32 y (ties: even code; a zero
    keeps y's sign)."""
    codes, vals = code_table(dtype)
    yd = y.double().reshape(-1, 1)
    err = (vals[None, :] - yd).abs()
    best = err.min(dim=1, keepdim=True).values
    cand = err == best
    even = (codes % 2 == 0)[None, :]
    neg = (codes >= 128)[None, :]
    # among the tied candidates prefer the even code, then the zero of y's sign
    score = cand.long() * 4 + (cand & even).long() * 2 + (cand & (neg == torch.signbit(yd))).long()
    return codes[score.argmax(dim=1)].reshape(y.shape)


def worst_case_rows(head_size: int, seed: int = 0) -> torch.Tensor:
    """[8, 2, head_size] float32 K (or V) rows: all zero, huge (1e36), at and over e4m3's 448 and at
    the 464 tie, float32 subnormals, tiny values beside a large one (codes flush to 0 or land on
    subnormal codes), negatives only, ordinary normals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 2, head_size, generator=g)
    x[0, 0] = 0.0
    x[0, 1] *= 1e36
    x[1, 0, :4] = torch.tensor([448.0, -500.0, 464.0, 300.0])
    x[1, 1] *= 1e-40  # subnormal floats
    x[2, 0] *= 1e-3
    x[2, 0, 0] = 1e4
    x[2, 1] = -x[2, 1].abs()
    x[3, 0] = 0.0
    x[3, 0, 5] = -2.0 ** -140  # one subnormal entry in an otherwise zero row
    return x


@pytest.mark.parametrize("dtype", QDTYPES, ids=IDS)
@pytest.mark.parametrize("head_size", [16, 64])
def test_quantize_kv_against_float64_oracle(dtype, head_size):
    x = torch.cat([worst_case_rows(head_size),
                   5 * torch.randn(64, 2, head_size, generator=torch.Generator().manual_seed(head_size))])
    codes, scale = reference.quantize_kv(x, dtype)
    qmax = reference.KV_QUANT_MAX[dtype]
    amax = x.abs().amax(-1)
    want_scale = amax / torch.tensor(qmax)
    # 1 where the row is all zero, or its absmax so small that absmax / max underflows to 0 (row [3, 0])
    want_scale = torch.where(want_scale > 0, want_scale, torch.ones_like(want_scale))
    assert scale.dtype == torch.float32
    assert torch.equal(scale, want_scale)
    y = (x / want_scale[..., None]).clamp(-qmax, qmax)
    assert torch.equal(codes.view(torch.uint8).long(), nearest_codes(y, dtype))
    # every dequantized value within half a code step of x (float64), the bound of rounding to nearest
    _, vals = code_table(dtype)
    vals = vals.sort().values
    deq = reference.dequantize_kv(codes, scale).double()
    q = (x.double() / scale.double()[..., None]).clamp(-qmax, qmax)
    idx = torch.searchsorted(vals, q.reshape(-1)).clamp(1, len(vals) - 1)
    step = (vals[idx] - vals[idx - 1]).reshape(q.shape)
    err = (deq - x.double()).abs()
    # plus float32's own rounding: x / scale is formed, and code * scale returned, in float32 (a value
    # within an ulp of a midpoint may take the other code; the product rounds): 2^-22 of |x| covers both
    bound = 0.5 * step * scale.double()[..., None] * (1 + 1e-6) + x.double().abs() * 2.0 ** -22 + 1e-300
    inside = x.double().abs() <= qmax * scale.double()[..., None] * (1 + 1e-6)
    assert bool((err <= bound)[inside].all()), float((err - bound)[inside].max())
    # an all-zero row stays zero with scale 1
    assert torch.equal(deq[0, 0], torch.zeros(head_size, dtype=torch.float64)) and scale[0, 0] == 1


@pytest.mark.parametrize("dtype", QDTYPES, ids=IDS)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_native_write_bit_exact(variant, dtype, in_dtype):
    head_size, block_size, num_blocks = 64, 5, 9
    k = worst_case_rows(head_size, 1).to(in_dtype)
    v = (-0.5 * worst_case_rows(head_size, 2)).to(in_dtype)
    slots = torch.tensor([3, 19, 0, -1, 7, 44, 5, 18])
    shape = reference.kv_cache_shape(num_blocks, block_size, 2, head_size)
    sshape = reference.kv_scale_shape(num_blocks, block_size, 2)
    caches = []
    for op in (reference, native):
        kc = torch.full(shape, 7, dtype=torch.uint8).view(dtype)
        vc = torch.full(shape, 7, dtype=torch.uint8).view(dtype)
        ks, vs = torch.full(sshape, -3.0), torch.full(sshape, -3.0)
        op.reshape_and_cache(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
        caches.append([t.view(torch.uint8) if t.dtype == dtype else t for t in (kc, vc, ks, vs)])
    for r, n in zip(*caches):
        assert torch.equal(r, n)
    # the written slots hold exactly quantize_kv's codes and scales
    kq, ksc = reference.quantize_kv(k, dtype)
    blk, off = slots[slots >= 0] // block_size, slots[slots >= 0] % block_size
    assert torch.equal(caches[1][0].view(dtype)[blk, :, off].view(torch.uint8), kq[slots >= 0].view(torch.uint8))
    assert torch.equal(caches[1][2][blk, :, off], ksc[slots >= 0])


def quantized_case(seqs, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0, q_dtype=torch.float32):
    """Scattered blocks as test_attention.make_case, the context written through the reference
    writer (so codes and scales are as the engine stores them), garbage codes with scale 1 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    nbs = [(ctx + block_size - 1) // block_size for _, ctx in seqs]
    num_blocks = sum(nbs) + 7
    perm = torch.randperm(num_blocks, generator=g).tolist()
    block_table = torch.full((len(seqs), max(nbs) + 2), -1, dtype=torch.int32)
    shape = reference.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    sshape = reference.kv_scale_shape(num_blocks, block_size, num_kv_heads)
    kc = torch.full(shape, 37.0).to(dtype)  # garbage: large values wherever no context lives
    vc = torch.full(shape, -53.0).to(dtype)
    ks, vs = torch.ones(sshape), torch.ones(sshape)
    slots = []
    i = 0
    for s, (_, ctx) in enumerate(seqs):
        ids = perm[i:i + nbs[s]]
        i += nbs[s]
        block_table[s, :nbs[s]] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[t // block_size] * block_size + t % block_size for t in range(ctx)]
    n = len(slots)
    k = torch.randn(n, num_kv_heads, head_size, generator=g) * (1 + 3 * torch.rand(n, num_kv_heads, 1, generator=g))
    v = torch.randn(n, num_kv_heads, head_size, generator=g)
    reference.reshape_and_cache(k, v, kc, vc, torch.tensor(slots), k_scale=ks, v_scale=vs)  # (float caches: unused)
    q_lens = [q for q, _ in seqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = (torch.randn(int(qsl[-1]), num_heads, head_size, generator=g) * 1.5).to(q_dtype)
    seq_lens = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    return query, kc, vc, ks, vs, block_table, seq_lens, qsl


# Max abs error of attention over a quantized cache vs the float32 cache on quantized_case's random data
# (queries 1.5 * N(0, 1), keys up to 4x: sharp softmaxes, outputs up to ~4.6), measured over seeds 5-7:
# int8 0.09-0.16, fp8_e4m3 0.42-0.49, fp8_e5m2 0.82-1.25. Bounds: about 2x the largest.
ATTN_ERROR_BOUNDS = {torch.int8: 0.3, torch.float8_e4m3fn: 1.0, torch.float8_e5m2: 2.5}
DECODE = [(1, 1), (1, 17), (1, 100), (1, 700), (1, 1100)]
CHUNKED = [(1, 45), (20, 20), (37, 200), (1, 530), (64, 600), (3, 90)]


@pytest.mark.parametrize("dtype", QDTYPES, ids=IDS)
@pytest.mark.parametrize("seqs,num_heads,num_kv_heads,head_size,block_size,window,soft_cap", [
    (DECODE, 8, 2, 64, 16, 0, 0.0),
    (DECODE, 14, 2, 128, 16, 0, 0.0),
    (CHUNKED, 8, 2, 64, 16, 0, 0.0),
    (CHUNKED, 4, 4, 48, 7, 0, 0.0),
    (DECODE, 8, 2, 64, 16, 40, 0.0),
    (CHUNKED, 8, 2, 64, 7, 13, 5.0),
    (DECODE, 4, 1, 64, 5, 0, 30.0),
], ids=["decode", "decode-d128-g7", "chunked", "chunked-mha-bs7", "decode-window", "chunked-window-cap",
        "decode-mqa-cap"])
def test_native_attention_equals_reference(variant, dtype, seqs, num_heads, num_kv_heads, head_size,
                                           block_size, window, soft_cap):
    q, kc, vc, ks, vs, bt, sl, qsl = quantized_case(seqs, num_heads, num_kv_heads, head_size, block_size, dtype)
    scale = reference.softmax_scale(head_size)
    ref = reference.paged_attention(q, kc, vc, bt, sl, qsl, scale, sliding_window=window, logits_soft_cap=soft_cap,
                                    k_scale=ks, v_scale=vs)
    # the reference reads the quantized cache as its dequantized float values
    dense = reference.paged_attention(q, reference.dequantize_kv(kc, ks), reference.dequantize_kv(vc, vs), bt, sl,
                                      qsl, scale, sliding_window=window, logits_soft_cap=soft_cap)
    torch.testing.assert_close(ref, dense, atol=0, rtol=0)
    out = native.paged_attention(q, kc, vc, bt, sl, qsl, scale, sliding_window=window, logits_soft_cap=soft_cap,
                                 k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


# the largest finite code of each format, as a storage byte (its negative: | 0x80; int8 also -128),
# and its value
EXTREME_CODES = {torch.int8: (0x7F, 127.0), torch.float8_e4m3fn: (0x7E, 448.0), torch.float8_e5m2: (0x7B, 57344.0)}


@pytest.mark.parametrize("dtype", QDTYPES, ids=IDS)
@pytest.mark.parametrize("head_size,kmag,vscale", [(64, 0.13, 1e6), (80, 0.013, 3e30), (64, 1300.0, 1.0)],
                         ids=["d64-spread", "d80-huge-v", "d64-sharp"])
def test_native_decode_extreme_codes(variant, dtype, head_size, kmag, vscale):
    # Worst-case codes through the decode path of the default model's shape (9 query heads over 3 KV
    # heads: three rows share each code load, 4 x 8 dims of V per pass; head size 80 adds a 16-dim
    # tail): every code at the format's largest magnitude (int8 also -128), signs random, with large
    # V scales (3e30 * 57344 is 1.7e35, float32's max 3.4e38; sums stay finite as the weights sum to
    # 1) and K scales that put K's values near kmag: spread-out (0.13), near-flat (0.013) or one-hot
    # (1300) softmaxes. Against the
    # reference over the same cache, with the kernels' 2e-5 tolerance taken relative to the largest
    # |V| value rather than to the output: an output is a convex combination of V rows whose random
    # signs cancel (outputs ~1/25 of |V| at 700 keys), so another summation order moves it by
    # ~1e-7 * |V| terms, not by 1e-7 * |output| (the generic variant is ~1e-4 * |output| off here).
    # One wrong code or scale moves an output by its softmax weight (>= ~1/1400 here) times |V|,
    # far outside the bound.
    g = torch.Generator().manual_seed(11)
    BS, ctx, nkv, nh = 16, 700, 3, 9
    nb = (ctx + BS - 1) // BS + 3
    shape = reference.kv_cache_shape(nb, BS, nkv, head_size)
    top, top_value = EXTREME_CODES[dtype]
    def codes():
        b = torch.full(shape, top, dtype=torch.uint8) | (torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7)
        if dtype == torch.int8:  # 0x7f | 0x80 = 0xff is -1: use -128 (0x80) and -127 (0x81) instead
            b = torch.where(b == 0xFF, torch.tensor(0x80 + torch.randint(0, 2, (), generator=g).item(),
                                                    dtype=torch.uint8), b)
        return code_bytes_as(dtype, b)
    kc, vc = codes(), codes()
    sshape = reference.kv_scale_shape(nb, BS, nkv)
    ks = torch.full(sshape, kmag / top_value) * (1 + torch.rand(sshape, generator=g))
    vs = torch.full(sshape, vscale) * (1 + torch.rand(sshape, generator=g) * 0.1)
    bt = torch.randperm(nb, generator=g).to(torch.int32)[: (ctx + BS - 1) // BS].view(1, -1)
    sl = torch.tensor([ctx], dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    q = torch.randn(1, nh, head_size, generator=g)
    scale = reference.softmax_scale(head_size)
    ref = reference.paged_attention(q, kc, vc, bt, sl, qsl, scale, k_scale=ks, v_scale=vs)
    assert ref.isfinite().all()
    out = native.paged_attention(q, kc, vc, bt, sl, qsl, scale, k_scale=ks, v_scale=vs)
    vmax = float(reference.dequantize_kv(vc, vs).abs().max())
    torch.testing.assert_close(out, ref, atol=2e-5 * vmax, rtol=2e-5)


@pytest.mark.parametrize("dtype", QDTYPES, ids=IDS)
def test_native_attention_bf16_query(variant, dtype):
    # bf16 activations over a quantized cache: the output rounds to bf16 (one ulp: 2e-2 as test_attention)
    q, kc, vc, ks, vs, bt, sl, qsl = quantized_case(CHUNKED, 8, 2, 64, 16, dtype, seed=3, q_dtype=torch.bfloat16)
    scale = reference.softmax_scale(64)
    ref = reference.paged_attention(q, kc, vc, bt, sl, qsl, scale, k_scale=ks, v_scale=vs).float()
    out = native.paged_attention(q, kc, vc, bt, sl, qsl, scale, k_scale=ks, v_scale=vs)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_quantized_attention_close_to_float_cache():
    # What quantizing costs on random data (a check of the scheme, not of a kernel): attention outputs
    # over int8 / fp8 caches against the same K/V in a float32 cache. Measured max abs errors on outputs
    # as ATTN_ERROR_BOUNDS says; more mantissa bits, less error (int8 < e4m3 < e5m2).
    errs = []
    for dtype, bound in ATTN_ERROR_BOUNDS.items():
        q, kc, vc, ks, vs, bt, sl, qsl = quantized_case(CHUNKED, 8, 2, 64, 16, dtype, seed=5)
        _, kf, vf, _, _, _, _, _ = quantized_case(CHUNKED, 8, 2, 64, 16, torch.float32, seed=5)
        scale = reference.softmax_scale(64)
        out = reference.paged_attention(q, kc, vc, bt, sl, qsl, scale, k_scale=ks, v_scale=vs)
        want = reference.paged_attention(q, kf, vf, bt, sl, qsl, scale)
        err = float((out - want).abs().max())
        assert err <= bound, (dtype, err)
        assert err > bound / 50, (dtype, err)  # the cache really is quantized
        errs.append(err)
    assert errs == sorted(errs), errs


def test_missing_scales_refused():
    shape = reference.kv_cache_shape(2, 4, 1, 16)
    kc = torch.zeros(shape, dtype=torch.int8)
    with pytest.raises(ValueError, match="k_scale"):
        reference.reshape_and_cache(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), kc, kc.clone(), torch.tensor([0]))


def test_kv_cache_torch_dtype_names():
    assert reference.kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert reference.kv_cache_torch_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    assert reference.kv_cache_torch_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*int8.*'fp4'"):
        reference.kv_cache_torch_dtype("fp4", torch.float32)


def code_bytes_as(dtype, b: torch.Tensor) -> torch.Tensor:
    """Storage bytes (uint8) viewed as a cache of ``dtype``."""
    return b.to(torch.uint8).view(torch.int8 if dtype == torch.int8 else dtype)


@pytest.mark.parametrize("dtype", QDTYPES, ids=IDS)
def test_every_code_of_v_read_exactly(variant, dtype):
    # All 256 codes as V through the native decode kernel (each variant's vector loads): four
    # one-token sequences (softmax weight exactly 1) whose V rows hold codes 64s .. 64s + 63 with a
    # scale of 0.3 (not a power of two: the kernel's folded scale must round as code * scale does).
    # Output = code value * scale, bit for bit the reference's dequantized value; NaN / inf codes give
    # NaN / inf as torch's float8 types do. The finite values also against the format's definition.
    D, BS = 64, 16
    shape = reference.kv_cache_shape(4, BS, 1, D)
    sshape = reference.kv_scale_shape(4, BS, 1)
    vb = torch.zeros(shape, dtype=torch.uint8)
    vb[:, 0, 0, :] = torch.arange(256, dtype=torch.uint8).view(4, D)
    vc = code_bytes_as(dtype, vb)
    kc = code_bytes_as(dtype, torch.zeros(shape, dtype=torch.uint8))
    ks, vs = torch.ones(sshape), torch.full(sshape, 0.3)
    bt = torch.arange(4, dtype=torch.int32).view(4, 1)
    sl = torch.ones(4, dtype=torch.int32)
    qsl = torch.arange(5, dtype=torch.int32)
    q = torch.randn(4, 1, D, generator=torch.Generator().manual_seed(0))
    scale = reference.softmax_scale(D)
    out = native.paged_attention(q, kc, vc, bt, sl, qsl, scale, k_scale=ks, v_scale=vs).reshape(256)
    ref = reference.paged_attention(q, kc, vc, bt, sl, qsl, scale, k_scale=ks, v_scale=vs).reshape(256)
    torch.testing.assert_close(out, ref, atol=0, rtol=0, equal_nan=True)
    codes, vals = code_table(dtype)
    want = (vals.float() * torch.tensor(0.3)).float()
    assert torch.equal(out[codes], want)
    finite = torch.zeros(256, dtype=torch.bool)
    finite[codes] = True
    assert int((~finite).sum()) == {torch.int8: 0, torch.float8_e4m3fn: 2, torch.float8_e5m2: 8}[dtype]
    assert not out[~finite].isfinite().any()


@pytest.mark.parametrize("dtype", QDTYPES, ids=IDS)
def test_every_finite_code_of_k_read(variant, dtype):
    # Every finite code as K through Q.K^T: one two-token sequence per code, the first key holding the
    # code (dim 0), the second zero; V = 1 and 0, so the output is sigmoid(score). The query is
    # +-2 / (softmax scale * the code's value from the format's definition), so the score is exactly
    # +-2 when the kernel decodes the code right and at least 1/8 off when it decodes it as any other
    # code (the output then moves by > 1e-2, far outside the 2e-5 bound).
    codes, vals = code_table(dtype)
    n, D, BS = len(codes), 16, 16
    shape = reference.kv_cache_shape(n, BS, 1, D)
    sshape = reference.kv_scale_shape(n, BS, 1)
    kb = torch.zeros(shape, dtype=torch.uint8)
    kb[:, 0, 0, 0] = codes.to(torch.uint8)
    one = {torch.int8: 1, torch.float8_e4m3fn: 0x38, torch.float8_e5m2: 0x3C}[dtype]  # the code of 1.0
    vb = torch.zeros(shape, dtype=torch.uint8)
    vb[:, 0, 0, :] = one
    kc, vc = code_bytes_as(dtype, kb), code_bytes_as(dtype, vb)
    ks, vs = torch.ones(sshape), torch.ones(sshape)
    scale = reference.softmax_scale(D)
    q = torch.zeros(n, 1, D)
    q[:, 0, 0] = torch.where(vals == 0, torch.ones_like(vals), 2.0 / (scale * vals)).float()
    bt = torch.arange(n, dtype=torch.int32).view(n, 1)
    sl = torch.full((n,), 2, dtype=torch.int32)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    out = native.paged_attention(q, kc, vc, bt, sl, qsl, scale, k_scale=ks, v_scale=vs)[:, 0, 0]
    ref = reference.paged_attention(q, kc, vc, bt, sl, qsl, scale, k_scale=ks, v_scale=vs)[:, 0, 0]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    want = torch.where(vals == 0, torch.full_like(vals, 0.5), torch.sigmoid(torch.full_like(vals, 2.0))).float()
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_kv_scales_ok_takes_only_the_kernels_layout():
    # the scales the native kernels read (else the reference runs): float32, contiguous, on the CPU,
    # the cache's [num_blocks, num_kv_heads, block_size]; a float cache needs none
    kc = torch.zeros(reference.kv_cache_shape(3, 4, 2, 16), dtype=torch.int8)
    good = torch.ones(reference.kv_scale_shape(3, 4, 2))
    assert native.kv_scales_ok(kc, good, good.clone())
    assert native.kv_scales_ok(torch.zeros(reference.kv_cache_shape(3, 4, 2, 16)), None, None)
    bad = [None, good.double(), good.transpose(1, 2).contiguous(), good.transpose(1, 2).contiguous().transpose(1, 2),
           torch.ones(3, 2, 5), good[:2], good.view(-1)]
    for b in bad:
        assert not native.kv_scales_ok(kc, good, b), b if b is None else (b.dtype, tuple(b.shape), b.stride())
