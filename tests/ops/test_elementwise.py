"""RMSNorm, fused add+RMSNorm, rotary embedding, SiLU-and-mul, and the polynomial exp: every
variant against the torch reference.

Tolerances: float32 2e-6 abs + 2e-6 rel (summation order, FMA contraction, a polynomial exp with
<2e-7 relative error); bfloat16 outputs may differ by one bf16 rounding step (2^-8 relative).
"""
from __future__ import annotations

import pytest
import torch

from appliance.ops import native, reference

F32_TOL = dict(atol=2e-6, rtol=2e-6)
BF16_TOL = dict(atol=1e-2, rtol=8e-3)


def tol(dtype):
    return F32_TOL if dtype == torch.float32 else BF16_TOL


# --- exp: the documented error bound ---------------------------------------------------------

EXP_MAX_REL_ERROR = 2e-7  # kernel_common.h: Cephes polynomial, ~1.2e-7 (about 2 ulp) measured


def test_exp_error_bound(variant):
    x = torch.cat([torch.linspace(-87.3, 88.3, 1_000_003), torch.linspace(-1, 1, 100_001),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    y = native.exp_approx(x).double()
    e = torch.exp(x.double())
    rel = ((y - e) / e).abs().max().item()
    assert rel < EXP_MAX_REL_ERROR, f"{variant}: max relative error {rel:.3e}"


def test_exp_saturation(variant):
    # Below the range (masked scores are -inf) the result is exactly 0, never NaN.
    x = torch.tensor([float("-inf"), -1e30, -200.0, -87.5, -88.0])
    assert torch.equal(native.exp_approx(x), torch.zeros(5))
    assert torch.isfinite(native.exp_approx(torch.tensor([88.3, 100.0, 1e30]))).all()
    # Odd lengths exercise the vector tails.
    for n in (1, 3, 7, 15, 17, 31, 33):
        x = torch.randn(n) * 10
        torch.testing.assert_close(native.exp_approx(x), torch.exp(x), atol=0, rtol=3e-7)


# --- RMSNorm ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 896), (3, 5, 4096), (2, 13)])
def test_rms_norm(variant, dtype, w_dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(w_dtype)
    out = native.rms_norm(x, w, 1e-6)
    ref = reference.rms_norm(x, w, 1e-6)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (9, 896), (4, 2048)])
def test_fused_add_rms_norm(variant, dtype, shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g).to(dtype)
    res = torch.randn(shape, generator=g).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    res_ref, res_nat = res.clone(), res.clone()
    out_ref, r_ref = reference.fused_add_rms_norm(x, res_ref, w, 1e-5)
    out_nat, r_nat = native.fused_add_rms_norm(x, res_nat, w, 1e-5)
    assert r_nat is res_nat  # updated in place and returned, as the reference does
    torch.testing.assert_close(res_nat, res_ref, atol=0, rtol=0)  # the add rounds identically
    torch.testing.assert_close(out_nat, out_ref, **tol(dtype))


def test_fused_add_rms_norm_mixed_dtypes(variant):
    x = torch.randn(3, 256)
    res = torch.randn(3, 256).bfloat16()
    w = torch.rand(256) + 0.5
    a, b = res.clone(), res.clone()
    out_ref, _ = reference.fused_add_rms_norm(x, a, w, 1e-6)
    out_nat, _ = native.fused_add_rms_norm(x, b, w, 1e-6)
    torch.testing.assert_close(b, a, atol=0, rtol=0)
    torch.testing.assert_close(out_nat, out_ref, **BF16_TOL)


# --- rotary -----------------------------------------------------------------------------------

@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size,rotary_dim", [(64, 64), (128, 128), (128, 64), (80, 32)])
def test_rotary_embedding(variant, is_neox, dtype, head_size, rotary_dim):
    g = torch.Generator().manual_seed(2)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    cache = reference.rotary_cos_sin_cache(inv_freq, 4096)
    positions = torch.randint(0, 4096, (19,), generator=g)
    q = torch.randn(19, 8, head_size, generator=g).to(dtype)
    k = torch.randn(19, 2, head_size, generator=g).to(dtype)
    q0, k0 = q.clone(), k.clone()
    qr, kr = reference.rotary_embedding(positions, q, k, cache, is_neox)
    qn, kn = native.rotary_embedding(positions, q, k, cache, is_neox)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # inputs untouched, like the reference
    torch.testing.assert_close(qn, qr, **tol(dtype))
    torch.testing.assert_close(kn, kr, **tol(dtype))


def test_rotary_bf16_cache_and_views(variant):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    cache = reference.rotary_cos_sin_cache(inv_freq, 512, dtype=torch.bfloat16)
    positions = torch.arange(5, 12)
    for t in (7, 1):  # a decode step's single token too
        qkv = torch.randn(t, 12 * 64)  # the model's fused q/k/v output, split and viewed as heads
        q, k = qkv[:, :8 * 64].view(t, 8, 64), qkv[:, 8 * 64:10 * 64].view(t, 2, 64)
        before = qkv.clone()
        qr, kr = reference.rotary_embedding(positions[:t], q, k, cache, True)
        qn, kn = native.rotary_embedding(positions[:t], q, k, cache, True)  # read in place, one pass
        assert torch.equal(qkv, before)
        torch.testing.assert_close(qn, qr, **F32_TOL)
        torch.testing.assert_close(kn, kr, **F32_TOL)


# --- SiLU and mul -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 128), (5, 2 * 4864), (2, 3, 2 * 100), (4, 2)])
def test_silu_and_mul(variant, dtype, shape):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    x[0, ..., 0] = -100.0  # exp overflow side of silu
    out = native.silu_and_mul(x)
    ref = reference.silu_and_mul(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **tol(dtype))


# --- argmax over rows (greedy sampling): exactly torch.argmax ----------------------------------


@pytest.mark.parametrize("shape", [(64, 49152), (1, 49152), (3, 17), (5, 1), (2, 1000)], ids=str)
def test_argmax_rows_matches_torch(variant, shape):
    g = torch.Generator().manual_seed(shape[0] * 131 + shape[1])
    x = torch.randn(*shape, generator=g)
    assert torch.equal(native.argmax(x), torch.argmax(x, dim=-1))


def test_argmax_rows_ties_inf_nan_and_strides(variant):
    x = torch.randn(6, 300)
    x[0, 7] = x[0, 250] = 100.0  # tie: the first one wins
    x[1] = float("-inf")  # all -inf: index 0
    x[2, 5] = float("inf")
    x[3, 40] = float("nan")  # NaN counts as the maximum, as torch.argmax
    x[3, 41] = 1e30
    x[4, 299] = 50.0  # last element
    x[5, 0] = 50.0  # first element
    want = torch.argmax(x, dim=-1)
    assert want.tolist()[:4] == [7, 0, 5, 40]
    assert torch.equal(native.argmax(x), want)
    wide = torch.randn(6, 512)
    wide[:, :300] = x
    view = wide[:, :300]  # rows 512 apart
    assert not view.is_contiguous()
    assert torch.equal(native.argmax(view), want)


def test_argmax_falls_back_for_other_inputs():
    x = torch.randn(4, 33, dtype=torch.bfloat16)
    assert torch.equal(native.argmax(x), torch.argmax(x, dim=-1))
    x3 = torch.randn(2, 3, 40)
    assert torch.equal(native.argmax(x3), torch.argmax(x3, dim=-1))
