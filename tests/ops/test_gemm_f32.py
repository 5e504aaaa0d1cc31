"""gemm_f32 (float linear backend ``native``) on every variant this CPU supports, against the fp64
product of the same weights, and the ``Linear`` layer on that backend against ``F.linear``.

fp32 accumulation over K terms of size ~|x||w| gives errors ~ eps * sqrt(K) * |x||w| per output; the
bound used, ``4e-6 * max|y| * sqrt(K / 64) + 1e-6``, is several times the worst measured (1.3e-6 *
max|y| at K=576). A wrong panel, row block, tail mask or bias would be off by O(max|y|)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from appliance.layers.linear import Linear, native_gemm_available
from appliance.ops import native

# (N, K): the default model's decode/prefill shapes (q/k/v fused, o, gate/up, down), then tails: N not a
# multiple of the 32-column panel (33, 1, 100), K not a multiple of the 4-step unroll (17, 130), one panel.
SHAPES = [(960, 576), (576, 1536), (3072, 576), (33, 17), (1, 64), (100, 130), (32, 8)]
# rows: single decode, partial row blocks (the AVX2 block's passes: 3; 4 = 2 + 2; 5 = 3 + 2; 7 = 3 + 2 + 2; the NEON
# block's pairs and a single row), more than one block (9, 12 = 8 + 2 + 2, 14), a full pass (128), two passes
ROWS = (1, 3, 4, 5, 7, 9, 12, 14, 64, 128, 200)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == want.shape and y.dtype == torch.float32
    if want.numel() == 0:
        return
    tol = 4e-6 * want.abs().max().item() * (w.shape[1] / 64) ** 0.5 + 1e-6
    err = (y.double() - want).abs().max().item()
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gemm_f32_matches_fp64(variant, shape):
    n, k = shape
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g)
    wp = native.pack_f32(w)
    assert wp.shape == (-(-n // 32), k, 32)
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        _check(native.gemm_f32(x, wp, None, n), x, w, None)
        _check(native.gemm_f32(x, wp, b, n), x, w, b)


# Outputs of 8 MiB or more (decode logits) are written with streaming stores where the variant has
# them: whole aligned panels only, the rest (a tail panel, a row stride off 64 bytes) as usual.
# n: every panel whole; a 16-column tail panel; a row stride that is not a multiple of 64 bytes.
@pytest.mark.parametrize("n", [32768 + 32, 32768 + 48, 32768 + 8], ids=str)
def test_gemm_f32_large_output(variant, n):
    g = torch.Generator().manual_seed(n)
    k = 24
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g)
    wp = native.pack_f32(w)
    for m in (64, 67):
        assert m * n * 4 >= 8 << 20
        x = torch.randn(m, k, generator=g)
        _check(native.gemm_f32(x, wp, b, n), x, w, b)
        _check(native.gemm_f32(x, wp, None, n), x, w, None)


def test_gemm_f32_no_rows_and_batched_input(variant):
    w = torch.randn(40, 24)
    wp = native.pack_f32(w)
    assert native.gemm_f32(torch.empty(0, 24), wp, None, 40).shape == (0, 40)
    x = torch.randn(2, 5, 24)  # leading dims are flattened and restored
    _check(native.gemm_f32(x, wp, None, 40).reshape(10, 40), x.reshape(10, 24), w, None)
    xt = torch.randn(24, 6).t()  # non-contiguous input
    _check(native.gemm_f32(xt, wp, None, 40), xt, w, None)


def test_gemm_f32_rejects_wrong_packing():
    w = torch.randn(40, 24)
    with pytest.raises(RuntimeError, match="gemm_f32: wp"):
        native.gemm_f32(torch.randn(3, 24), w, None, 40)  # not packed
    with pytest.raises(RuntimeError, match="gemm_f32: bias"):
        native.gemm_f32(torch.randn(3, 24), native.pack_f32(w), torch.randn(39), 40)


def test_linear_native_backend_matches_f_linear():
    assert native_gemm_available(torch.float32, torch.device("cpu"))
    lin = Linear(48, 70, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(70, 48) * 0.1)
        lin.bias.copy_(torch.randn(70))
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.set_backend("native")
    assert lin.backend == "native" and lin.weight.numel() == 0  # only the packed copy is kept
    x = torch.randn(5, 48)
    _check(lin(x), x, w, b)


def test_linear_native_backend_refuses_bfloat16():
    lin = Linear(32, 32).to(torch.bfloat16)
    assert "native" not in lin.candidates(torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="linear backend native needs float32"):
        lin.set_backend("native")


@pytest.mark.parametrize("inter,k,bias", [(1536, 576, False), (48, 40, True), (16, 7, True)], ids=str)
def test_gemm_f32_silu_mul_matches_silu_and_mul(variant, inter, k, bias):
    """The MLP's gate/up GEMM with silu(gate) * up in its epilogue (rows interleaved by gate_up_order)
    equals the unfused route, F.silu(x gate^T) * (x up^T), in fp64: the GEMM bound above, carried
    through silu and the product (|d out| <= (|up| + |silu(gate)|) * tol), plus the exp polynomial's
    relative error (test_elementwise)."""
    g = torch.Generator().manual_seed(inter + k)
    w = torch.randn(2 * inter, k, generator=g) * 0.1
    b = torch.randn(2 * inter, generator=g) if bias else None
    order = native.gate_up_order(inter)
    wp = native.pack_f32(w[order])
    for m in (1, 9, 130):
        x = torch.randn(m, k, generator=g)
        h = F.linear(x.double(), w.double(), None if b is None else b.double())
        want = F.silu(h[:, :inter]) * h[:, inter:]
        got = native.gemm_f32(x, wp, None if b is None else b[order].contiguous(), 2 * inter, silu_mul=True)
        assert got.shape == (m, inter)
        tol = 4e-6 * h.abs().max().item() * (k / 64) ** 0.5 + 1e-6
        bound = tol * (2 * h.abs().max().item() + 1) + 1e-5 * want.abs()
        assert ((got.double() - want).abs() <= bound).all()


def test_gate_up_order_needs_whole_panels():
    assert native.gate_up_order(24) is None  # 24 gate rows do not fill 16-row halves
    assert native.gate_up_order(32).tolist()[:18] == list(range(16)) + [32, 33]


def test_linear_native_gate_up_fused_and_plain_forward():
    """A [gate; up] Linear on the native backend packs its rows interleaved: forward_silu_mul is the
    fused route, and the plain forward still returns the un-permuted projection."""
    lin = Linear(40, 64, bias=True)
    lin.silu_mul_next = True
    with torch.no_grad():
        lin.weight.copy_(torch.randn(64, 40) * 0.1)
        lin.bias.copy_(torch.randn(64))
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.set_backend("native")
    assert lin.fused_silu_mul
    x = torch.randn(3, 40)
    _check(lin(x), x, w, b)
    h = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(lin.forward_silu_mul(x).double(), F.silu(h[:, :32]) * h[:, 32:], atol=1e-5, rtol=1e-5)
