"""GGUF block types kept quantized (``appliance.models.gguf_quants``): each type's blocks in the
canonical form, dequantized (``qmath.dequantize``, fp64), against ``gguf.quants.dequantize`` of the
same bytes, and as ``QuantLinear`` layers on every method of their scheme that takes them.

Tolerances. Symmetric types (Q4_0, Q5_0, Q8_0, Q6_K, Q3_K) are exact: the canonical fp64 value
equals gguf's fp32 one. Types with a min (Q4_1, Q5_1, Q4_K, Q5_K, Q2_K) round the zero point to
fp32, moving a weight by at most ``2^-24 |zp * scale|``, and gguf's own fp32 sum ``S u - M`` is
rounded by up to ``2^-24 |w|``: we allow ``2^-24 (|zp * scale| + |w|)`` per weight (times
``1 + 2^-10`` for the fp64 steps before the zero point's rounding). A group whose scale is 0 (every
weight ``-M``) is exact.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from helpers import assert_matches_reference, skip_unless_backend

from appliance.errors import ModelLoadError
from appliance.layers import quant
from appliance.layers.methods.qmath import dequantize
from appliance.layers.quant import QuantLinear
from appliance.models import gguf_quants
from appliance.models.gguf_quants import KEPT, canonical, kept

# type -> byte offsets of its fp16 fields (d, and dmin / m where it has one), from gguf.quants' layouts
FP16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
           "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}
# what each type becomes (the module docstring's table)
EXPECTED = {"Q4_0": ("w4a8", 32, False), "Q4_1": ("w4a8", 32, True), "Q4_K": ("w4a8", 32, True),
            "Q5_0": ("w8a8", 32, False), "Q5_1": ("w8a8", 32, True), "Q5_K": ("w8a8", 32, True),
            "Q8_0": ("w8a8", 32, False), "Q6_K": ("w8a8", 16, False), "Q3_K": ("w8a8", 16, False),
            "Q2_K": ("w8a8", 16, True)}
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf.quants.quantize supports these
F16_MAX = 65504.0


def _qtype(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name]


def _set_f16(blocks: np.ndarray, at: int, values) -> None:
    blocks[:, at:at + 2] = np.asarray(values, dtype=np.float16).reshape(-1, 1).view(np.uint8)


def _random_blocks(name: str, n: int, k: int, rng, scale: float = 1e-3) -> np.ndarray:
    """Random bytes as a GGUF tensor of ``n`` rows by ``k`` inputs would hold them ([n, bytes per
    row], as GGUFReader gives ``tensor.data``), every fp16 field finite: normal * ``scale``."""
    bt = KEPT[name]
    raw = rng.integers(0, 256, (n, k // bt.block_size * bt.type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, bt.type_size)
    for at in FP16_AT[name]:
        _set_f16(blocks, at, rng.standard_normal(len(blocks)) * scale)
    return raw


def _worst_blocks(name: str) -> np.ndarray:
    """One block per combination of payload byte (0x00: every nibble / plane / sub-scale 0; 0xFF:
    all 15 / 31 / 63 and sub-scales 63, Q6_K's int8 sub-scales -1; 0x7F and 0x80: Q8_0's and Q6_K's
    +127 / -128; 0x55, 0xAA: alternating bits) and fp16 field values (0, -0, +-1, the smallest
    subnormal, +-65504, the largest fp16, which keeps every weight finite)."""
    bt = KEPT[name]
    values = [0.0, -0.0, 1.0, -1.0, 2.0 ** -24, F16_MAX, -F16_MAX, 3.0e-3]
    payloads = [0x00, 0xFF, 0x7F, 0x80, 0x55, 0xAA]
    fields = FP16_AT[name]
    combos = [(p, v0, v1) for p in payloads for v0 in values for v1 in (values if len(fields) == 2 else [0.0])]
    blocks = np.empty((len(combos), bt.type_size), dtype=np.uint8)
    for i, (p, v0, v1) in enumerate(combos):
        blocks[i] = p
        for at, v in zip(fields, (v0, v1)):
            blocks[i:i + 1, at:at + 2] = np.array([v], dtype=np.float16).view(np.uint8)
    # rows of one block each; pad to whole rows of 256 inputs for the 32-weight types
    per_row = 256 // bt.block_size
    pad = -len(blocks) % per_row
    blocks = np.concatenate([blocks, np.repeat(blocks[:1], pad, axis=0)])
    return blocks.reshape(-1, per_row * bt.type_size)


def _assert_is_gguf(name: str, raw: np.ndarray, n: int, k: int) -> gguf_quants.QuantWeight:
    w = canonical(name, raw, n, k)
    want32 = gguf_dequantize(raw, _qtype(name)).reshape(n, k)
    assert np.isfinite(want32).all()
    want = torch.from_numpy(want32).double()
    got = dequantize(w.qweight, w.scale, w.zero_point)
    lo, hi = (-8, 7) if w.scheme == "w4a8" else (-128, 127)
    assert w.qweight.dtype == torch.int8 and lo <= w.qweight.min() and w.qweight.max() <= hi
    assert w.scale.dtype == torch.float32 and w.scale.shape == (n, k // w.group)
    if w.zero_point is None:
        assert torch.equal(got, want), f"{name}: max error {(got - want).abs().max().item():.3g}"
        return w
    assert w.zero_point.dtype == torch.float32 and w.zero_point.shape == w.scale.shape
    zs = (w.zero_point.double() * w.scale.double()).abs().repeat_interleave(w.group, dim=1)
    bound = 2.0 ** -24 * (zs + want.abs()) * (1 + 2.0 ** -10)
    err = (got - want).abs()
    assert (err <= bound).all(), f"{name}: max excess {(err - bound).max().item():.3g}"
    return w


# ---------------------------------------------------------------- the registry

def test_registry_names_and_layouts():
    """Every kept type is named as gguf names it, with gguf's block geometry, and says what it becomes
    without decoding anything; types not kept answer None."""
    assert set(KEPT) == set(EXPECTED)
    for name, (scheme, group, has_zp) in EXPECTED.items():
        bt = kept(name)
        assert (bt.scheme, bt.group, bt.has_zero_point) == (scheme, group, has_zp), name
        assert (bt.block_size, bt.type_size) == gguf.GGML_QUANT_SIZES[_qtype(name)]
        assert _qtype(name).name == name
    assert kept("F16") is None and kept("IQ4_XS") is None and kept("F32") is None


# ---------------------------------------------------------------- blocks -> canonical form, exactly

@pytest.mark.parametrize("name", QUANTIZABLE)
def test_quantized_floats_match_gguf(name):
    """Blocks from gguf's own quantizer (normal weights, outlier columns, a constant group, a zero
    group), as GGUFReader lays them out: [rows, bytes per row]."""
    rng = np.random.default_rng(1)
    n, k = 24, 256
    rows = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    rows[:, :3] *= 10
    rows[1, :32], rows[2, 32:64], rows[3, :] = 0.3, 0.0, -2.5e-3
    raw = gguf.quants.quantize(rows, _qtype(name))
    assert raw.shape == (n, k // 32 * KEPT[name].type_size)
    w = _assert_is_gguf(name, raw, n, k)
    if w.zero_point is not None:  # the constant groups (d == 0) are exact
        want = gguf_dequantize(raw, _qtype(name)).reshape(n, k)
        got = dequantize(w.qweight, w.scale, w.zero_point).float().numpy()
        for r, cols in ((1, slice(0, 32)), (2, slice(32, 64)), (3, slice(None))):
            assert np.array_equal(got[r, cols], want[r, cols]), r


@pytest.mark.parametrize("name", list(EXPECTED))
def test_random_blocks_match_gguf(name):
    """Random bytes (every nibble, plane and sub-scale pattern) with finite fp16 fields."""
    rng = np.random.default_rng(2)
    for scale in (1e-3, 1.0, 1e3):
        _assert_is_gguf(name, _random_blocks(name, 16, 512, rng, scale), 16, 512)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_worst_case_blocks_match_gguf(name):
    """All nibbles 0 and 15 (31, 63), sub-scales 0 and 63, int8 extremes, d and dmin 0, -0,
    negative, the smallest subnormal and +-65504; groups with scale 0 are exact."""
    raw = _worst_blocks(name)
    n, k = raw.shape[0], 256
    w = _assert_is_gguf(name, raw, n, k)
    if w.zero_point is not None:
        want = torch.from_numpy(gguf_dequantize(raw, _qtype(name)).reshape(n, k)).double()
        got = dequantize(w.qweight, w.scale, w.zero_point)
        blocks = raw.reshape(-1, KEPT[name].type_size)
        d = torch.from_numpy(blocks[:, FP16_AT[name][0]:FP16_AT[name][0] + 2].copy().view(np.float16)[:, 0].astype(
            np.float32)).reshape(n, -1)
        flat = (d == 0).repeat_interleave(KEPT[name].block_size, dim=1)
        assert flat.any() and torch.equal(got[flat], want[flat])
        assert torch.isfinite(w.zero_point).all() and (w.scale != 0).all()


def test_q6_k_keeps_its_sixteen_sub_scales():
    """Q6_K is W8 group 16: q = u - 32 over the whole [-32, 31], scale d * sc (int8 sc, -128 too)."""
    raw = _worst_blocks("Q6_K")
    w = canonical("Q6_K", raw, raw.shape[0], 256)
    assert w.group == 16 and w.qweight.min() == -32 and w.qweight.max() == 31
    assert w.zero_point is None and w.scale.shape == (raw.shape[0], 16)


# ---------------------------------------------------------------- layers on every method that takes them

def _layer_cases():
    for name, (scheme, group, _) in EXPECTED.items():
        for backend in quant.BACKENDS[scheme]:
            yield name, backend


@pytest.mark.parametrize("name,backend", list(_layer_cases()))
def test_layer_on_every_method_matches_its_reference(name, backend):
    """A QuantLinear holding each type's blocks, on every method of its scheme that takes the layer
    (held to the fp64 reference at the tolerance of tests/quant/test_kernels.py); the methods that
    do not take it say so (W8 groups: only w8a8_native). The fp64 reference, before packing, is
    within the A8 activation rounding of ``x @ w^T`` with gguf's own dequantized weights."""
    rng = np.random.default_rng(3)
    n, k = 48, 512
    raw = _random_blocks(name, n, k, rng, scale=2e-3)
    w = canonical(name, raw, n, k)
    m = quant.methods.get(backend)
    if not m.takes(n, k, w.group):
        assert w.scheme == "w8a8" and backend != "w8a8_native", backend
        return
    if hasattr(m, "takes_values") and not m.takes_values(w.qweight):  # values beyond 6 / 5 bits
        assert (backend, name) in {("w6a8_native", "Q8_0"), ("w5a8_native", "Q8_0"), ("w5a8_native", "Q6_K")}, \
            (name, backend)
        return
    skip_unless_backend(backend)
    zp = w.zero_point
    assert_matches_reference(backend, w.qweight, w.scale, zp)

    layer = QuantLinear(k, n, w.scheme, w.group, w8_groups=True)
    layer.qweight.data, layer.weight_scale.data = w.qweight.clone(), w.scale.clone()
    if zp is not None:
        layer.weight_zero_point.data = zp.clone()
    assert (layer.weight_zero_point is not None) == (w.scheme == "w4a8" or w.group != k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5))
    unpacked = layer(x).double()  # the fp64 reference of the layer's scheme (w8a8_native's for W8 groups)
    full = x.double() @ torch.from_numpy(gguf_dequantize(raw, _qtype(name))).reshape(n, k).double().t()
    # Only the symmetric part q * scale meets rounded activations: A8 moves each by at most one step
    # (range / 255, per token; half a step, plus one where the zero point's rounding clamps), the W4
    # reference's bf16 activations, scales and offsets by 2^-9 relative each.
    sym = dequantize(w.qweight, w.scale).abs()
    zs = torch.zeros_like(sym) if zp is None else \
        (zp.double() * w.scale.double()).abs().repeat_interleave(w.group, dim=1)
    step = (x.amax(1).clamp(min=0) - x.amin(1).clamp(max=0)).double() / 255
    bound = step[:, None] * sym.sum(1)[None] + 2 ** -7 * (x.abs().double() @ (sym + zs).t())
    assert ((unpacked - full).abs() <= bound).all(), ((unpacked - full).abs() - bound).max()
    layer.set_backend(backend)
    got = layer(x).double()
    want = quant.reference(backend, x, w.qweight, w.scale, None, zp)
    tol = 2e-5 * want.abs().max().item() * (k / 576) ** 0.5 + 1e-6
    if backend == "w4a16_int4pack":  # bf16 output
        tol += 2 ** -8 * want.abs().max().item()
    assert (got - want).abs().max() <= tol


# ---------------------------------------------------------------- bad input

def test_wrong_byte_count_names_type_and_sizes():
    raw = _random_blocks("Q4_K", 4, 256, np.random.default_rng(0))
    with pytest.raises(ModelLoadError) as e:
        canonical("Q4_K", raw[:, :-1], 4, 256, where="m.gguf: tensor 'blk.0.attn_q.weight'")
    msg = str(e.value)
    assert msg.startswith("m.gguf: tensor 'blk.0.attn_q.weight': Q4_K weight [4, 256]")
    assert "expected 576 bytes (4 blocks of 144)" in msg and "got 572" in msg, msg
    with pytest.raises(ModelLoadError, match=r"Q6_K weight \[4, 128\]: 128 inputs is not a multiple of the "
                                             r"Q6_K block of 256"):
        canonical("Q6_K", raw, 4, 128)
    with pytest.raises(ModelLoadError, match="GGUF type IQ4_XS is not kept quantized"):
        canonical("IQ4_XS", raw, 4, 256)
    with pytest.raises(ModelLoadError, match="expected 576 bytes"):
        canonical("Q4_K", raw.view(np.int8), 4, 256)  # the bytes must be uint8, as GGUFReader gives them


# ---------------------------------------------------------------- native unpacking == numpy

@pytest.mark.parametrize("name", list(EXPECTED))
def test_native_unpacking_is_the_numpy_reference(name, monkeypatch):
    """``appliance_native.gguf_unpack_q`` (Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K) gives the numpy decoders'
    canonical form bit for bit: q, scale, zero point and K-quant scales, on random and worst-case
    blocks (zero-scale groups included) and on a read-only array (a GGUF's mmap). Where the
    extension is not built the decoders say so by returning None and numpy decodes."""
    from appliance.ops import native

    rng = np.random.default_rng(3)
    raws = [(_random_blocks(name, 16, 512, rng, s), 16, 512) for s in (1e-3, 1.0, 1e3)]
    worst = _worst_blocks(name)
    raws.append((worst, worst.shape[0], 256))
    ro = raws[0][0].copy()
    ro.setflags(write=False)
    raws.append((ro, 16, 512))
    natively = name in gguf_quants._NATIVE_KIND
    blocks = np.ascontiguousarray(raws[0][0]).reshape(-1, KEPT[name].type_size)
    if not native.is_available():
        assert gguf_quants._native_q("Q4_0", blocks) is None and native.unavailable_reason()
        pytest.fail(f"native extension not built ({native.unavailable_reason()}): nothing to compare")
    if natively:  # Q8_0 (a view of the bytes), Q3_K and Q2_K stay numpy
        assert gguf_quants._native_q(name, blocks) is not None
    for raw, n, k in raws:
        got = canonical(name, raw, n, k)
        monkeypatch.setattr(gguf_quants, "USE_NATIVE", False)
        want = canonical(name, raw, n, k)
        monkeypatch.setattr(gguf_quants, "USE_NATIVE", True)
        assert torch.equal(got.qweight, want.qweight), name
        assert torch.equal(got.scale, want.scale)
        assert (got.zero_point is None) == (want.zero_point is None)
        if got.zero_point is not None:
            assert torch.equal(got.zero_point, want.zero_point)
        if want.kquant is not None:
            for f in ("sub", "submin", "sup", "supmin"):
                a, b = getattr(got.kquant, f), getattr(want.kquant, f)
                assert (a is None and b is None) or torch.equal(a, b), f


def test_native_unpacking_checks_its_input():
    from appliance.ops import native

    if not native.is_available():
        pytest.fail(f"native extension not built ({native.unavailable_reason()})")
    ext = native._require()
    with pytest.raises(RuntimeError, match=r"blocks contiguous uint8 \[B, 18\]"):
        ext.gguf_unpack_q(torch.zeros(4, 20, dtype=torch.uint8), 0)
    with pytest.raises(RuntimeError, match="kind must be 0..6; got 7"):
        ext.gguf_unpack_q(torch.zeros(4, 18, dtype=torch.uint8), 7)
