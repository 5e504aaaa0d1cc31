"""gemm_bf16 (float linear backend ``native_bf16``) on every variant this CPU supports, against the fp64
product of the same bf16 weights (and activations), and the ``Linear`` layer on that backend against
torch's ``F.linear`` in fp32 of the bf16 weights.

Bound (rigorous, not fitted): an output is a sum of K products accumulated in fp32 (exact products for
bf16 x bf16; one rounding each for fp32 x; VDPBF16PS / BFDOT add two products per step), so each of
its ~K + 2 operations moves it by at most one fp32 ulp of a partial sum, |partial| <= sum_k |x_k w_k|
+ |b|: |err| <= 2^-23 (K + 2) (sum_k |x_k w_k| + |b|). A bf16 output adds its own rounding, 2^-8 |y|.
A wrong panel, column, k pair, odd-K pad or tail is off by O(sum |x w| / sqrt(K)): tens to hundreds of
times the bound at these sizes (test_bound_catches_a_wrong_pair shows it).

The AVX512-BF16 path (VDPBF16PS) runs only where the CPU has avx512_bf16; elsewhere the dispatcher must
not offer it (test_dot_product_variant_offered_only_with_the_isa). The Arm paths (NEON widening,
BFDOT on Neoverse V1/V2) are proven under qemu by native/neon_sve/harness (tests/arm64)."""
from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from appliance.layers.linear import Linear, float_candidates
from appliance.ops import native
from appliance.runtime.cpu_features import detect

ROWS = (1, 3, 4, 7, 8, 17, 64)  # decode, partial (4 = 2 + 2, 7 = 3 + 2 + 2 on AVX2) / whole / several 8-row blocks
KS = (64, 576, 1000, 1001)  # a small layer, the default model's hidden size, off the unrolls, odd (a padded pair)
NS = (100, 40)  # a partial last panel (100 = 3 x 32 + 4; 40 = 32 + 8)


def _bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out_bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp64 reference, per-element bound) for x [M, K] and w [N, K] as the kernel sees them."""
    xd, wd = x.double(), w.double()
    ref = F.linear(xd, wd, None if b is None else b.double())
    mag = F.linear(xd.abs(), wd.abs(), None if b is None else b.double().abs())
    bound = 2.0 ** -23 * (x.shape[1] + 2) * mag + 1e-30
    if out_bf16:
        bound = bound + 2.0 ** -8 * ref.abs()
    return ref, bound


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    ref, bound = _bound(x, w, b, y.dtype == torch.bfloat16)
    assert y.shape == ref.shape and y.dtype == x.dtype
    err = (y.double() - ref).abs()
    worst = (err / bound).max().item()
    assert (err <= bound).all(), f"max error / bound = {worst:.3g}"


def _case(m: int, n: int, k: int, large: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    if large:  # x ~ 1e6, w ~ 1e3, mixed signs, each odd k cancelling the even one before it: y ~ 0
        w = torch.randn(n, k, generator=g) * 1e3
        w[:, 1::2] = -w[:, 0:k - 1:2] * (1 + 1e-3 * torch.randn(n, k // 2, generator=g))
        x = torch.randn(m, k, generator=g) * 1e6
    else:
        w = torch.randn(n, k, generator=g) * 0.1
        x = torch.randn(m, k, generator=g)
    return x, w.to(torch.bfloat16), torch.randn(n, generator=g)


@pytest.mark.parametrize("k", KS, ids=lambda k: f"K{k}")
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemm_bf16_matches_fp64(variant, k, xdtype):
    for n in NS:
        for m in ROWS:
            x, wb, b = _case(m, n, k, False, m * 1000 + n + k)
            wp = native.pack_bf16(wb)
            assert wp.shape == (-(-n // 32), -(-k // 2), 32, 2) and wp.dtype == torch.bfloat16
            xk = x.to(xdtype)
            _check(native.gemm_bf16(xk, wp, None, n), xk, wb, None)
            _check(native.gemm_bf16(xk, wp, b, n), xk, wb, b)


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemm_bf16_worst_case_magnitudes(variant, xdtype):
    """Large magnitudes of mixed signs whose products cancel pairwise: the result is small against
    sum |x w| (~1e9 per term), where a lost or doubled pair shows at once."""
    for m, n, k in ((3, 70, 1001), (17, 40, 576), (1, 100, 64)):
        x, wb, b = _case(m, n, k, True, m + n + k)
        xk = x.to(xdtype)
        _check(native.gemm_bf16(xk, native.pack_bf16(wb), b, n), xk, wb, b)


def test_bound_catches_a_wrong_pair():
    """The bound is tight enough to fail a kernel that drops one k pair, swaps a pair's halves or shifts
    a column: each such mistake, applied to the fp64 reference, breaks it."""
    x, wb, b = _case(8, 100, 576, False, 7)
    ref, bound = _bound(x, wb, b, False)
    for wrong in (wb.clone().index_fill_(1, torch.tensor([200, 201]), 0),      # pair 100 dropped
                  wb[:, torch.arange(576).view(-1, 2).flip(1).reshape(-1)],    # halves of every pair swapped
                  wb.roll(1, 0)):                                               # columns shifted by one
        y = F.linear(x.double(), wrong.double(), b.double())
        assert ((y - ref).abs() > bound).any()


def test_pack_bf16_layout():
    w = torch.arange(33 * 5, dtype=torch.float32).view(33, 5).to(torch.bfloat16)
    wp = native.pack_bf16(w)
    assert wp.shape == (2, 3, 32, 2)
    for p, kk, j, i in ((0, 0, 0, 0), (0, 0, 0, 1), (0, 2, 7, 0), (1, 1, 0, 1), (1, 0, 0, 0)):
        assert wp[p, kk, j, i] == w[32 * p + j, 2 * kk + i]
    assert (wp[0, 2, :, 1] == 0).all()  # K = 5 padded with a zero
    assert (wp[1, :, 1:] == 0).all()  # rows past N = 33


def test_gemm_bf16_no_rows_batched_and_strided_input(variant):
    wb = (torch.randn(40, 24) * 0.1).to(torch.bfloat16)
    wp = native.pack_bf16(wb)
    assert native.gemm_bf16(torch.empty(0, 24, dtype=torch.bfloat16), wp, None, 40).shape == (0, 40)
    x = torch.randn(2, 5, 24, dtype=torch.bfloat16)  # leading dims are flattened and restored
    _check(native.gemm_bf16(x, wp, None, 40).reshape(10, 40), x.reshape(10, 24), wb, None)
    xt = torch.randn(24, 6, dtype=torch.bfloat16).t()  # non-contiguous input
    assert not xt.is_contiguous()
    _check(native.gemm_bf16(xt, wp, None, 40), xt, wb, None)
    xo = torch.randn(3 * 24 + 1, dtype=torch.bfloat16)[1:].view(3, 24)  # not 4-byte aligned: staged, not read as words
    assert xo.is_contiguous() and xo.data_ptr() % 4 == 2
    _check(native.gemm_bf16(xo, wp, None, 40), xo, wb, None)


def test_gemm_bf16_rejects_wrong_packing():
    wb = torch.randn(40, 24).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="gemm_bf16: wp"):
        native.gemm_bf16(torch.randn(3, 24), wb, None, 40)  # not packed
    with pytest.raises(RuntimeError, match="gemm_bf16: wp"):
        native.gemm_bf16(torch.randn(3, 24), native.pack_bf16(wb).float(), None, 40)  # not bf16
    with pytest.raises(RuntimeError, match="gemm_bf16: bias"):
        native.gemm_bf16(torch.randn(3, 24), native.pack_bf16(wb), torch.randn(39), 40)


def test_dot_product_variant_offered_only_with_the_isa():
    """VDPBF16PS (avx512bf16) is tested through the ``variant`` parameter wherever the CPU has it; a CPU
    without avx512_bf16 must not be offered it (never a silent skip: one of the two holds)."""
    names = native.available_variants()
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert ("avx512bf16" in names) == detect().has("avx512_bf16")
        assert "neon_bf16" not in names
    else:
        assert "avx512bf16" not in names


def test_linear_native_bf16_matches_f_linear_fp32():
    """A bfloat16 Linear on native_bf16 against F.linear of the same bf16 tensors in fp32, rounded once to
    bf16: equal up to fp32 summation order, i.e. within one bf16 rounding (2^-8 |y|) plus the fp32 bound."""
    assert "native_bf16" in float_candidates(torch.bfloat16, torch.device("cpu"))
    lin = Linear(96, 70, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(70, 96) * 0.1)
        lin.bias.copy_(torch.randn(70))
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.set_backend("native_bf16")
    assert lin.backend == "native_bf16" and lin.weight.numel() == 0
    assert lin.weight_bytes() == 3 * 48 * 32 * 2 * 2 + 70 * 2  # half the bytes of fp32 panels (+ the bf16 bias)
    x = torch.randn(5, 96).to(torch.bfloat16)
    y = lin(x)
    want = F.linear(x.float(), w.float(), b.float())
    assert y.dtype == torch.bfloat16
    tol = 2.0 ** -8 * want.abs() + 2.0 ** -23 * 98 * F.linear(x.float().abs(), w.float().abs(), b.float().abs())
    assert ((y.float() - want).abs() <= tol).all()


def test_native_bf16_is_a_bf16_only_candidate():
    cpu = torch.device("cpu")
    assert "native_bf16" in float_candidates(torch.bfloat16, cpu)
    assert "native_bf16" not in float_candidates(torch.float32, cpu)
    assert "native" not in float_candidates(torch.bfloat16, cpu)
    lin = Linear(32, 32)
    with pytest.raises(ValueError, match="linear backend native_bf16 needs bfloat16 weights"):
        lin.set_backend("native_bf16")


@pytest.mark.parametrize("silu_mul", [False, True])
def test_native_bf16_is_timed_in_the_per_shape_choice(silu_mul):
    """``auto`` times every candidate of a bf16 layer's shape (appliance.layers.linear.measure): native_bf16
    is one of them and runs there, plain and as a [gate; up] projection followed by silu_and_mul."""
    from appliance.layers import linear

    cands = float_candidates(torch.bfloat16, torch.device("cpu"))
    ran = []

    def timer(f):
        ran.append(f())
        return 1.0

    times = linear.measure(torch.empty(64, 96, dtype=torch.bfloat16), cands, rows=(1, 16), timer=timer,
                           silu_mul=silu_mul)
    assert set(times) == set(cands) and "native_bf16" in times
    assert all(y.dtype == torch.bfloat16 and y.shape[-1] == (32 if silu_mul else 64) for y in ran)
