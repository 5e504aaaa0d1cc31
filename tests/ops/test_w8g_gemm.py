"""gemm_w8g_a8 (W8A8 with group-wise weight scales; quant backend ``w8a8_native``) on every variant
this CPU supports, against the fp64 reference of the same quantized math (``quant.reference``).

The kernel quantizes activations exactly as ``quant._quant_act`` (per token, asymmetric int8) and
sums each group's integer products exactly; what remains is fp32 rounding: the group terms
``scale * int`` summed over K/G groups, then times the token scale. The tolerance is the one every
quantized backend is held to (tests/quant/test_kernels.py): ``2e-5 * max|y| * sqrt(K / 576) + 1e-6``
(measured: under 3e-7 * max|y|). A single activation rounded differently would move a result by about
``max|y| / (255 sqrt(K))``, far above it, so this also pins the activation quantization."""
from __future__ import annotations

import pytest
import torch

from appliance.layers import quant

# (N, K, group): decode/prefill shapes of the default model (q/k/v fused, o, gate/up, down),
# K not a multiple of 64 (96, 160), odd N (37, 1), per channel (None: kernel groups of 64/256/32),
# group 16 (GGUF Q6_K/Q3_K/Q2_K sub-blocks; K = 48 per channel too)
SHAPES = [(960, 576, 32), (576, 1536, 32), (3072, 576, None), (576, 1536, None), (37, 96, 32), (1, 160, 32),
          (200, 256, 64), (33, 96, None), (960, 576, 16), (37, 96, 16), (17, 48, None)]
ROWS = (1, 2, 3, 4, 5, 7, 16, 33)  # the x86 block takes tokens 4 at a time, then 3, 2 or 1 in one pass


def _case(n, k, group, seed, full_range=False):
    g = torch.Generator().manual_seed(seed)
    lo = -128 if full_range else -127
    q = torch.randint(lo, 128, (n, k), generator=g, dtype=torch.int8)
    gs = k if group is None else group
    s = (torch.rand(n, k // gs, generator=g) * 0.01 + 1e-4).half().float()  # fp16 scales, as Q8_0's
    return q, s


def _check(q, s, rows=ROWS, zp=None):
    n, k = q.shape
    p = quant.pack("w8a8_native", q, s, zp)
    for m in rows:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m)) * 2
        x[:, 0] += 3  # asymmetric rows: zero points away from 0
        got = quant.run("w8a8_native", p, x, n, k)
        want = quant.reference("w8a8_native", x, q, s, zero_point=zp)
        assert got.shape == (m, n) and got.dtype == torch.float32
        tol = 2e-5 * want.abs().max().item() * (k / 576) ** 0.5 + 1e-6
        err = (got.double() - want).abs().max().item()
        assert err <= tol, f"m={m}: max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_w8g_gemm_matches_fp64_reference(variant, shape):
    q, s = _case(*shape, seed=sum(shape[:2]))
    _check(q, s)


@pytest.mark.parametrize("group", [32, 16])
def test_w8g_gemm_minus_128_weights(variant, group):
    """q == -128 (a Q8_0 block may hold it): AVX2's sign trick cannot, those weights run the portable
    loop; every variant must still be exact."""
    q, s = _case(48, 192, group, seed=7, full_range=True)
    assert (q == -128).any()
    assert quant.pack("w8a8_native", q, s)["m128"]
    _check(q, s, rows=(1, 9))


@pytest.mark.parametrize("group", [32, 16])
def test_w8g_gemm_zero_points(variant, group):
    """Zero points (GGUF Q5_1/Q5_K at group 32, Q2_K at 16): the symmetric kernel plus
    ``group_sums(x) @ (-zero_point * scale)^T`` in fp32, held to the reference of that split. The
    tolerance is the one above; the zero points here (|zp * scale| up to ~10x the largest
    |q * scale|) add fp32 terms of that size: measured 1.1-1.6e-7 * max|y| (avx2, generic)."""
    q, s = _case(40, 256, group, seed=9, full_range=True)
    zp = (torch.randn(s.shape, generator=torch.Generator().manual_seed(10)) * 500).float()
    zp[0] = 0  # a row without
    assert quant.pack("w8a8_native", q, s, zp)["offset_t"] is not None
    _check(q, s, rows=(1, 2, 9), zp=zp)
    zero = torch.zeros_like(s)
    assert quant.pack("w8a8_native", q, s, zero)["offset_t"] is None  # all-zero zero points cost nothing
    _check(q, s, rows=(1,), zp=zero)


def test_w8g_gemm_zero_and_constant_rows(variant):
    """A zero token (scale clamped to 1e-12), a constant one, and zero weight groups."""
    q, s = _case(40, 128, 32, seed=3)
    q[5] = 0
    s[7, 1] = 0
    p = quant.pack("w8a8_native", q, s)
    x = torch.stack([torch.zeros(128), torch.full((128,), 0.7), torch.randn(128)])
    got = quant.run("w8a8_native", p, x, 40, 128)
    want = quant.reference("w8a8_native", x, q, s)
    assert (got.double() - want).abs().max() <= 1e-6 + 2e-5 * want.abs().max()
    assert torch.equal(got[0], torch.zeros(40))


def test_w8g_backend_validity():
    """Group-wise W8 goes to w8a8_native only; per-channel W8 to every W8 backend."""
    assert quant.backend_valid("w8a8_native", "w8a8", 64, 576, 32)
    assert quant.backend_valid("w8a8_native", "w8a8", 64, 576, 576)  # per channel: kernel group 64
    assert quant.backend_valid("w8a8_native", "w8a8", 64, 576, 16)  # GGUF Q6_K's sub-blocks
    assert not quant.backend_valid("w8a8_native", "w8a8", 64, 100, 100)  # K % 16
    assert not quant.backend_valid("w8a8_native", "w8a8", 64, 576, 8)  # no kernel group divides 8
    assert not quant.backend_valid("w8a8_onednn", "w8a8", 64, 576, 16)
    assert not quant.backend_valid("w8a16_int8pack", "w8a8", 64, 576, 16)
    assert not quant.backend_valid("w8a8_onednn", "w8a8", 64, 576, 32)
    assert not quant.backend_valid("w8a16_int8pack", "w8a8", 64, 576, 32)
    assert quant.backend_valid("w8a16_int8pack", "w8a8", 64, 576, 576)
    assert quant.pack("w8a8_native", *_case(16, 576, None, 0))["group"] == 64
    assert quant.pack("w8a8_native", *_case(16, 1536, None, 0))["group"] == 256


@pytest.mark.parametrize("group", [256, 16])
@pytest.mark.parametrize("pattern", ["all_max", "alternating_min_max", "random_extremes"])
def test_w8g_gemm_worst_case_for_overflow(variant, pattern, group):
    """The largest integer sums the kernel can meet, in its largest group (256; and the smallest, 16,
    whose 4-step groups take every loop's shortest path): activations coded
    127 (and -128) against weights 127 (and -128, -127), every product at its largest and of one sign
    (no cancellation to hide a clipped partial sum), at decode and prefill rows. A pair sum in int16
    (VPMADDUBSW on u8 255 x 127) or an int32 overflow would be off by far more than the tolerance."""
    n, k = 48, 512
    even = torch.arange(k) % 2 == 0
    if pattern == "all_max":
        q = torch.full((n, k), 127, dtype=torch.int8)
        q[n // 2:] = -127
        x_row = torch.ones(k)
    elif pattern == "alternating_min_max":
        q = torch.where(even, 127, -128).to(torch.int8)[None].repeat(n, 1)
        x_row = torch.where(even, 1.0, -0.99)  # codes 127 / -128 (not -1: a rounding tie)
    else:
        g = torch.Generator().manual_seed(11)
        q = torch.where(torch.rand(n, k, generator=g) < 0.5, 127, -128).to(torch.int8)
        x_row = torch.where(torch.rand(k, generator=g) < 0.5, 1.0, -0.99)
    s = torch.full((n, k // group), 0.01)
    p = quant.pack("w8a8_native", q, s)
    assert p["group"] == group
    for m in (1, 2, 3, 4, 9):
        x = x_row[None].repeat(m, 1)
        xq, _, _ = quant._quant_act(x)
        assert xq.max() == 127 and (pattern == "all_max" or xq.min() == -128)
        got = quant.run("w8a8_native", p, x, n, k)
        want = quant.reference("w8a8_native", x, q, s)
        size = (x.abs().double() @ quant.dequantize(q, s).abs().t()).max().item()
        err = (got.double() - want).abs().max().item()
        assert err <= 2e-6 * size, f"m={m}: max error {err:.3g} of sums up to {size:.3g}"
