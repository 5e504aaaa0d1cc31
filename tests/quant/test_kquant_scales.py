"""GGUF K-quants held with their own scales (``w4a8_native`` / ``w6a8_native``'s ``pack_kquant``, the
native ``gemm_wlow_a8`` with ``WLowArgs.ksuper``): per super-block of 256 the fp16 ``d`` (and ``dmin``)
as fp32, per group the int8 sub-scale (and sub-min), per row an fp32 sum and an int8 shift.

- Held weights: read back (``dequantize_rows``) they equal gguf's own ``dequantize`` of the blocks
  (computed in fp64 here): exactly for Q6_K and Q3_K (``d sc (u - 32)``, ``d (sc - 32) q`` are exact
  in fp32), within 2^-23 of the group's largest weight for the types with mins (Q4_K, Q5_K, Q2_K:
  ``d sc u - dmin mn`` rounded once to fp32).
- Outputs: against the fp64 reference of the math the kernel performs on the same weights
  (``method.reference`` of the canonical form: activations quantized per token, the zero point's
  term against the float activations), relative 2e-5 of the output scale: fp32 sums over groups, and
  the activations' zero point met by the row's fp32 sum rather than per group (one more rounding
  of a term of the output's size).
- Worst cases: every 4/6-bit value at an end of its range, sub-scales at their largest (63; Q6_K's
  int8 127 and -128), ``d``/``dmin`` at fp16's largest (65504) and smallest subnormal (2^-24),
  activations coded 127 / -128 with nothing cancelling: the same tolerance.
- A fused layer mixing Q4_K and Q6_K shards (a Q4_K_M file's q/k with its v), held as one 6-bit
  layer: each row as its own type.
- Bytes held per weight (a row of K inputs; padding rows aside): Q4_K 0.5 + 2 / 32 + 8 / 256
  = 0.59375 (+ 5 / K per row), against the file's 0.5625 and the fp32-group form's 0.8125; Q6_K
  0.75 + 1 / 16 + 4 / 256 = 0.828125 (+ 4 / K), against 0.8203 and 1.125; Q3_K as Q6_K (0.828125,
  file 0.4297); Q2_K 0.75 + 2 / 16 + 8 / 256 = 0.90625 (+ 5 / K), against 0.3281 and 1.375.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from gguf_files import random_blocks, worst_blocks
from helpers import kquant_reference

from appliance.layers import methods
from appliance.layers.quant import QuantLinear, _kquant_tables, packed_bytes
from appliance.models.gguf_quants import KEPT, canonical
from appliance.ops import native

pytestmark = pytest.mark.skipif(not native.is_available(), reason="the native kernels are not built")

W4, W6 = methods.get("w4a8_native"), methods.get("w6a8_native")
_SYMMETRIC = ("Q6_K", "Q3_K")  # no mins: d sc q exact in fp32


def _blocks(qtype: str, n: int, k: int, rng) -> np.ndarray:
    """Random K-quant blocks (gguf cannot quantize K-quants) with realistic fp16 d / dmin."""
    return random_blocks(qtype, n, k, rng)


def _tables(cw, n: int, k: int, group: int | None = None) -> dict:
    return _kquant_tables({None: cw.kquant}, {}, n, k, group or cw.group)


def _reference_weights(qtype: str, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(n, k)).double()


def _check_outputs(m, p, qweight, t, k, xs=None):
    for x in xs or [torch.randn(rows, k) + (torch.arange(k) == 0) * 3.0 for rows in (1, 3, 9, 20)]:
        y = m.apply(p, x).double()
        ref = kquant_reference(x, qweight, t)
        assert (y - ref).abs().max().item() <= 2e-5 * ref.abs().max().item(), x.shape


@pytest.mark.parametrize("qtype,m", [("Q4_K", W4), ("Q6_K", W6), ("Q5_K", W6), ("Q4_K", W6), ("Q3_K", W6),
                                     ("Q2_K", W6)])
@pytest.mark.parametrize("n,k", [(40, 512), (17, 768)])
def test_held_weights_are_ggufs_dequantization_and_outputs_the_reference(qtype, m, n, k):
    rng = np.random.default_rng(2)
    raw = _blocks(qtype, n, k, rng)
    cw = canonical(qtype, raw, n, k)
    t = _tables(cw, n, k)
    assert m.takes_kquant(cw.qweight, t)
    p = m.pack_kquant(cw.qweight, t)
    want = _reference_weights(qtype, raw, n, k)
    got = m.dequantize_rows(p, torch.arange(n)).double()
    groupmax = want.abs().reshape(n, -1, 16).amax(-1, keepdim=True)
    tol = 0.0 if qtype in _SYMMETRIC else 2.0 ** -23
    assert ((got - want).reshape(n, -1, 16).abs() <= tol * groupmax + 1e-30).all()
    _check_outputs(m, p, cw.qweight, t, k)
    # the method's own reference of the canonical form: the same math (random blocks have groups of scale 0)
    assert qtype in _SYMMETRIC or (cw.kquant.sub == 0).any()
    x = torch.randn(3, k)
    ref = m.reference(x, cw.qweight, cw.scale, zero_point=cw.zero_point)
    assert (m.apply(p, x).double() - ref).abs().max().item() <= 2e-5 * ref.abs().max().item()
    per_weight = packed_bytes(p) / (((n + 15) // 16 * 16) * k)
    mins = cw.kquant.submin is not None
    want_bpw = (m.bits / 8 + (2 if mins else 1) / cw.group + (8 if mins else 4) / 256
                + (4 + (1 if cw.kquant.shift else 0)) / k)
    assert per_weight == pytest.approx(want_bpw)
    per_row = (4 + (1 if cw.kquant.shift else 0)) / k
    if (qtype, m.bits) == ("Q4_K", 4):  # the file: 0.5625; the fp32-group form: 0.8125
        assert per_weight - per_row == 0.59375
    if qtype in ("Q6_K", "Q3_K"):  # the file: 0.8203 / 0.4297; the fp32-group form: 1.125
        assert per_weight - per_row == 0.828125
    if qtype == "Q2_K":  # the file: 0.3281; the fp32-group form with offsets: 1.375
        assert per_weight - per_row == 0.90625


@pytest.mark.parametrize("qtype,m", [("Q4_K", W4), ("Q6_K", W6), ("Q5_K", W6), ("Q3_K", W6), ("Q2_K", W6)])
@pytest.mark.parametrize("k,rows", [(768, 37), (4096, 70)])
def test_many_rows_equal_each_row_alone(qtype, m, k, rows):
    """Prefill-sized inputs (a tile's weights unpacked once and met by several tokens at a time, in
    one or several token blocks) give every row bit for bit what it gives alone (decode's per-token
    loop), with the K-quant scales."""
    n = 80
    rng = np.random.default_rng(5)
    raw = _blocks(qtype, n, k, rng)
    cw = canonical(qtype, raw, n, k)
    t = _tables(cw, n, k)
    p = m.pack_kquant(cw.qweight, t)
    torch.manual_seed(5)
    x = torch.randn(rows, k) * torch.linspace(0.1, 4.0, rows)[:, None]
    y = m.apply(p, x)
    assert torch.equal(y, torch.cat([m.apply(p, x[i:i + 1]) for i in range(len(x))]))
    # 2e-5 of the output scale up to 768 inputs, growing with the number of fp32 group sums
    ref = kquant_reference(x, cw.qweight, t)
    assert (y.double() - ref).abs().max().item() <= 2e-5 * max(1, k / 768) * ref.abs().max().item()


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q3_K", "Q2_K"])
@pytest.mark.parametrize("scale_at", ["fp16_max", "fp16_min"])
def test_worst_case_blocks(qtype, scale_at):
    """Every weight at an end of its range (rows alternate which), the largest sub-scales and mins, d
    and dmin at fp16's largest / smallest subnormal, activations coded 127 / -128 with every product
    of one sign: the integer sums are at their largest and nothing cancels."""
    n, k = 32, 512
    raw = worst_blocks(qtype, n, k, np.random.default_rng(3), 65504.0 if scale_at == "fp16_max" else 2.0 ** -24)
    cw = canonical(qtype, raw, n, k)
    if qtype == "Q3_K":
        assert set(cw.kquant.sub.unique().tolist()) == {-32, 31} and set(cw.qweight.unique().tolist()) == {-4, 3}
    m = W4 if qtype == "Q4_K" else W6
    t = _tables(cw, n, k)
    p = m.pack_kquant(cw.qweight, t)
    want = _reference_weights(qtype, raw, n, k)
    got = m.dequantize_rows(p, torch.arange(n)).double()
    assert ((got - want).abs() <= 2.0 ** -23 * want.abs().amax()).all()
    kk = torch.arange(k)
    x = torch.where(kk % 2 == 1, -1.0, 0.99).reshape(1, k).repeat(2, 1)
    from appliance.layers.methods.qmath import quant_act

    assert set(quant_act(x)[0].unique().tolist()) == {-128.0, 127.0}  # the codes at their ends
    # 2 rows: the per-token loop (decode); 6: a tile's chunk unpacked once for 4 tokens at a time
    _check_outputs(m, p, cw.qweight, t, k, [x, x.abs(), x.repeat(3, 1), x.abs().repeat(3, 1)])


def test_fused_layer_mixing_q4_k_and_q6_k_rows():
    """q/k as Q4_K and v as Q6_K in one fused layer (widened to W8 groups of 16): one 6-bit layer whose
    rows each keep their own type's scales, shifts and mins."""
    rng = np.random.default_rng(4)
    k, shards = 512, {"q": (0, 32), "k": (32, 16), "v": (48, 16)}
    types = {"q": "Q4_K", "k": "Q4_K", "v": "Q6_K"}
    lin = QuantLinear(k, 64, "w8a8", 16, shards=shards, w8_groups=True)
    from appliance.layers.weight_loading import QuantizedWeight, load_quant_linear

    raws = {}
    for sid, (o, r) in shards.items():
        raws[sid] = raw = _blocks(types[sid], r, k, rng)
        cw = canonical(types[sid], raw, r, k)
        load_quant_linear(lin, lin.qweight, QuantizedWeight(cw.qweight, cw.scale, cw.zero_point, cw.group, cw.scheme,
                                                            cw.kquant), sid)
    assert lin.preferred_backend() == "w6a8_native"
    qweight, t = lin.qweight.data.clone(), lin.kquant_tables()
    lin.set_backend("w6a8_native")
    assert "kf" in lin.packed and lin.packed["flags"] == 3
    want = torch.cat([_reference_weights(types[s], raws[s], shards[s][1], k) for s in shards])
    got = W6.dequantize_rows(lin.packed, torch.arange(64)).double()
    assert ((got - want).reshape(64, -1, 16).abs()
            <= 2.0 ** -23 * want.abs().reshape(64, -1, 16).amax(-1, keepdim=True) + 1e-30).all()
    _check_outputs(W6, lin.packed, qweight, t, k)
    # the layer as the decoder stack runs it, and what it holds: 0.75 + (1 + 1) / 16 + 8 / 256 + 5 / k
    d = lin.fused_descriptor()
    assert d.kind == 8 and d.ints == (16, 6, 256 | 3 << 16)
    assert packed_bytes(lin.packed) / (64 * k) == pytest.approx(0.75 + 2 / 16 + 8 / 256 + 5 / k)


def test_layer_without_k_quant_scales_everywhere_keeps_the_group_form():
    """A fused layer one of whose shards has no K-quant scales (a Q8_0 v): the fp32 group form, as before."""
    rng = np.random.default_rng(5)
    k = 256
    lin = QuantLinear(k, 32, "w8a8", 16, shards={"a": (0, 16), "b": (16, 16)}, w8_groups=True)
    from appliance.layers.weight_loading import QuantizedWeight, load_quant_linear

    cw = canonical("Q6_K", _blocks("Q6_K", 16, k, rng), 16, k)
    load_quant_linear(lin, lin.qweight, QuantizedWeight(cw.qweight, cw.scale, None, 16, "w8a8", cw.kquant), "a")
    load_quant_linear(lin, lin.qweight, QuantizedWeight(cw.qweight, cw.scale, None, 16, "w8a8"), "b")
    assert lin.kquant_tables() is None and lin.preferred_backend() is None


@pytest.mark.parametrize("qtype", ["Q3_K", "Q2_K"])
def test_q3_k_and_q2_k_layers_keep_their_scales(qtype):
    """A Q3_K / Q2_K layer (W8 groups of 16, values in [-4, 3] / [-2, 1]) is given to ``w6a8_native``
    without measuring and held with its own scales: each weight gguf's dequantization, the output the
    kernel's fp64 reference, and against float activations (the fp64 product of gguf's weights) within
    the per-token A8 rounding."""
    rng = np.random.default_rng(6)
    n, k = 48, 512
    raw = _blocks(qtype, n, k, rng)
    cw = canonical(qtype, raw, n, k)
    lin = QuantLinear(k, n, "w8a8", 16, w8_groups=True)
    from appliance.layers.weight_loading import QuantizedWeight, load_quant_linear

    rec = QuantizedWeight(cw.qweight, cw.scale, cw.zero_point, 16, "w8a8", cw.kquant)
    load_quant_linear(lin, lin.qweight, rec, None)
    assert lin.preferred_backend() == "w6a8_native"
    t = lin.kquant_tables()
    assert t["shift"].unique().tolist() == [KEPT[qtype].kshift] and (t["submin"] is None) == (qtype == "Q3_K")
    lin.set_backend("w6a8_native")
    assert "kf" in lin.packed and lin.packed["flags"] == (0 if qtype == "Q3_K" else 3)
    want = _reference_weights(qtype, raw, n, k)
    got = W6.dequantize_rows(lin.packed, torch.arange(n)).double()
    tol = 0.0 if qtype in _SYMMETRIC else 2.0 ** -23
    assert ((got - want).reshape(n, -1, 16).abs() <= tol * want.abs().reshape(n, -1, 16).amax(-1, keepdim=True)
            + 1e-30).all()
    x = torch.randn(5, k)
    y = lin(x).double()
    ref = kquant_reference(x, cw.qweight, t)
    assert (y - ref).abs().max().item() <= 2e-5 * ref.abs().max().item()
    exact = x.double() @ want.t()  # float activations: A8's per-token rounding, ~1% of the output scale
    assert (y - exact).abs().max().item() <= 0.02 * exact.abs().max().item()
