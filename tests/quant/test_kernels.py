"""Every quantized linear backend against an fp64 reference of the same quantized math, per shape;
the quantizers and the compressed-tensors int4 packing against their definitions."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_matches_reference, skip_unless_backend

from appliance.layers import methods, quant
from appliance.layers.linear import Linear, select_backends

# (out, in): SmolLM2-135M's q/k/v (fused), o, gate/up (fused) and down; odd sizes; Qwen2.5-0.5B's down
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (200, 256), (896, 4864)]
CASES = [("w8a8", None, b) for b in quant.BACKENDS["w8a8"]] + \
        [("w4a8", g, b) for g in (None, 32, 64, 128) for b in quant.BACKENDS["w4a8"]]


def _weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[:, :3] *= 8  # a few outlier columns, as real checkpoints have
    return w


def _valid(scheme, group, backend, n, k) -> bool:
    """Whether the backend takes this shape (a backend this host lacks counts as taking it: its tests
    assert the refusal and skip, saying why)."""
    g = k if group is None else group
    return k % g == 0 and (quant.backend_valid(backend, scheme, n, k, g) or quant.host_problem(backend) is not None)


# Only the combinations a backend accepts; the others are held to refusal below.
VALID = [(c, s) for c in CASES for s in SHAPES if _valid(*c, *s)]
INVALID = [(c, s) for c in CASES for s in SHAPES if not _valid(*c, *s)]


@pytest.mark.parametrize("case,shape", INVALID, ids=lambda v: str(v))
def test_backend_refuses_shapes_it_cannot_run(case, shape):
    """A backend that cannot take a shape/group says so (and so is never a candidate for it)."""
    scheme, group, backend = case
    n, k = shape
    g = k if group is None else group
    if k % g:  # a group size that does not divide the input dimension: no backend takes it
        with pytest.raises(Exception):
            quant.quantize_int4(_weights(n, k), g)
    else:  # torch's int4 weight-only kernel is the only backend with further shape limits
        assert backend == "w4a16_int4pack" and not quant.backend_valid(backend, scheme, n, k, g)


@pytest.mark.parametrize("case,shape", VALID, ids=lambda v: str(v))
def test_backend_matches_fp64_reference(case, shape):
    scheme, group, backend = case
    skip_unless_backend(backend)
    n, k = shape
    g = k if group is None else group
    w = _weights(n, k)
    qw, s, *zp = quant.quantize_int8(w) if scheme == "w8a8" else quant.quantize_int4(w, g)
    bits = getattr(methods.get(backend), "bits", 8)
    if scheme == "w8a8" and bits < 8:  # w6a8_native / w5a8_native take W8 layers whose values fit 6 / 5 bits
        qw = qw.clamp(-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    assert_matches_reference(backend, qw, s, zp[0] if zp else None)


@pytest.mark.parametrize("backend", quant.BACKENDS["w4a8"])
def test_gguf_block_scales_match_reference(backend):
    """W4 as a GGUF's Q4_0/Q4_1 blocks load (appliance.models.gguf_loader): group 32, fp16 scales that
    bf16 does not hold (the kernels round them when packing), negative ones (Q4_0's d = max / -8),
    zero points 0 or -8 - m / d."""
    n, k = 960, 576
    g = torch.Generator().manual_seed(3)
    qw = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    d = (torch.randn(n, k // 32, generator=g) * 0.004).half().float()
    assert not torch.equal(d, d.bfloat16().float()) and (d < 0).any()
    m = (torch.randn(n, k // 32, generator=g) * 0.03).half().float()
    zp = torch.where(torch.arange(n)[:, None] < n // 2, 0.0, (-8 - m.double() / d.abs().double()).float())
    assert_matches_reference(backend, qw, d, zp)
    assert_matches_reference(backend, qw, d.abs(), zp)


def test_gguf_q8_0_block_scales_match_reference():
    """W8 as a GGUF's Q8_0 blocks load: group 32, fp16 scales (negative ones too), every int8 value
    including -128. Only w8a8_native takes W8 groups of any values (w6a8_native those within 6 bits;
    per-variant checks: tests/ops/test_w8g_gemm.py)."""
    n, k = 960, 576
    g = torch.Generator().manual_seed(4)
    qw = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    d = (torch.randn(n, k // 32, generator=g) * 0.004).half().float()
    assert [b for b in quant.BACKENDS["w8a8"] if quant.backend_valid(b, "w8a8", n, k, 32)
            and getattr(methods.get(b), "takes_values", lambda q: True)(qw)] == ["w8a8_native"]
    assert_matches_reference("w8a8_native", qw, d, None)


@pytest.mark.parametrize("backend", ["w8a16_int8pack", "w4a16_int4pack", "w8a8_onednn", "w8a8_native", "w4a8_dynquant"])
def test_bf16_activations(backend):
    skip_unless_backend(backend)
    n, k = 256, 512
    scheme = "w8a8" if backend.startswith("w8") else "w4a8"
    lin = Linear(k, n)
    lin.weight.data = _weights(n, k)
    q = quant.QuantLinear.from_float(lin, scheme, 64)
    canonical = (q.qweight.data, q.weight_scale.data, q._zp())
    q.set_backend(backend)
    x = torch.randn(3, k).bfloat16()
    got = q(x)
    assert got.dtype == torch.bfloat16 and got.shape == (3, n)
    want = quant.reference(backend, x, canonical[0], canonical[1], zero_point=canonical[2])
    assert (got.double() - want).abs().max() <= 0.02 * want.abs().max()


def test_quantizers_round_to_nearest_symmetric():
    w = _weights(64, 256)
    q8, s8 = quant.quantize_int8(w)
    assert q8.dtype == torch.int8 and q8.abs().max() == 127 and s8.shape == (64, 1)
    assert torch.equal(q8, torch.round(w / s8).to(torch.int8))
    assert (quant.dequantize(q8, s8) - w.double()).abs().max() <= s8.max() / 2 + 1e-7
    q4, s4, z4 = quant.quantize_int4(w, 32)
    assert s4.shape == z4.shape == (64, 8) and torch.equal(s4, s4.bfloat16().float())  # bf16-exact group scales
    assert q4.min() == -8 and q4.max() == 7  # each group's min and max are on the grid
    err = (quant.dequantize(q4, s4, z4) - w.double()).abs().reshape(64, 8, 32)
    assert (err <= s4.double()[..., None] * 0.5 + 1e-6).all()
    with pytest.raises(ValueError, match="quant_group_size=48"):
        quant.quantize_int4(w, 48)


def test_int4_int32_packing_layout():
    q = torch.tensor([[-8, -7, 0, 1, 2, 3, 6, 7] * 2], dtype=torch.int8)
    packed = quant.pack_int4_to_int32(q)
    # value j of each run of 8 sits at bits 4j, offset by +8
    assert packed.shape == (1, 2)
    want = sum((v + 8) << (4 * j) for j, v in enumerate([-8, -7, 0, 1, 2, 3, 6, 7]))
    assert packed[0, 0].item() == torch.tensor(want & 0xFFFFFFFF, dtype=torch.int64).to(torch.int32).item() \
        or packed[0, 0].item() == want - (1 << 32)
    assert torch.equal(quant.unpack_int32_to_int4(packed, 16), q)


def test_fused_quantization_equals_per_shard():
    """q/k/v (gate/up) fused into one GEMM quantize to exactly what the shards would."""
    w = _weights(96, 128)
    for scheme in quant.SCHEMES:
        fq = quant.quantize_int8 if scheme == "w8a8" else (lambda t: quant.quantize_int4(t, 32))
        whole = fq(w)
        parts = [fq(w[a:b]) for a, b in ((0, 64), (64, 80), (80, 96))]
        for i, t in enumerate(whole):
            assert torch.equal(t, torch.cat([p[i] for p in parts]))


def test_select_backends_forces_and_rejects():
    model = torch.nn.Sequential(Linear(128, 64), Linear(64, 128))
    for m in model:
        m.weight.data = _weights(m.out_features, m.in_features)
    quant.quantize_model(model, "w8a8", None)
    choices = select_backends(model, "w8a16_int8pack", torch.float32, torch.device("cpu"))
    assert set(choices.values()) == {"w8a16_int8pack"}
    with pytest.raises(ValueError, match="w4a8_dynquant"):
        select_backends(model, "w4a8_dynquant", torch.float32, torch.device("cpu"))


def test_auto_measures_quantized_candidates_once_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path))
    calls = []
    real = quant.QuantLinear.measure

    def counting(self, candidates, rows, timer):
        calls.append((self.shape_key, tuple(candidates)))
        return real(self, candidates, (1,), timer)

    monkeypatch.setattr(quant.QuantLinear, "measure", counting)

    def build():
        model = torch.nn.Sequential(Linear(64, 128), Linear(64, 128), Linear(128, 64))
        for m in model:
            m.weight.data = _weights(m.out_features, m.in_features)
        return quant.quantize_model(model, "w4a8", 32)

    choices = select_backends(build(), "auto", torch.float32, torch.device("cpu"))
    w4 = ("w4a8_dynquant", "w4a16_int4pack", "w4a8_native")
    assert sorted(calls) == [("w4a8g32|128x64", w4), ("w4a8g32|64x128", w4)]  # once per shape
    assert set(choices) == {"w4a8 64x128", "w4a8 128x64"} and set(choices.values()) <= set(quant.BACKENDS["w4a8"])
    assert select_backends(build(), "auto", torch.float32, torch.device("cpu")) == choices
    assert len(calls) == 2  # the second model reads the cache


def _extreme_activations(k: int) -> list[torch.Tensor]:
    """Activations whose per-token int8 codes sit at the ends of the range: all +1 (every code 127,
    u8 255 where x86 oneDNN shifts by 128), alternating +1/-0.99 (codes 127 and -128, u8 255 and 0;
    not -1, which would put both on a rounding tie), random signs, and a row of zeros beside a row
    of huge values, at decode and prefill batch sizes."""
    g = torch.Generator().manual_seed(7)
    pm = torch.where(torch.arange(k) % 2 == 0, 1.0, -0.99)
    rand = torch.where(torch.randint(0, 2, (33, k), generator=g) == 1, 1.0, -0.99)
    return [torch.ones(1, k), pm[None].repeat(7, 1), rand * 1e4,
            torch.cat([torch.zeros(1, k), torch.full((1, k), 3e4), -torch.ones(1, k), pm[None]])]


def _extreme_weights(n: int, k: int, lo: int, hi: int) -> list[torch.Tensor]:
    """Integer weights at the ends of [lo, hi]: all hi, all lo, signs following the alternating
    activations (every product at its largest), and random extremes."""
    g = torch.Generator().manual_seed(8)
    alt = torch.where(torch.arange(k) % 2 == 0, hi, lo)
    rnd = torch.where(torch.randint(0, 2, (n, k), generator=g) == 1, hi, lo)
    out = []
    for w in (torch.full((n, k), hi), torch.full((n, k), lo), alt[None].repeat(n, 1), rnd):
        out.append(w.to(torch.int8))
    return out


@pytest.mark.parametrize("backend", quant.QUANT_BACKENDS)
def test_worst_case_inputs_match_reference(backend):
    """Every int8/int4 backend at the worst case for integer overflow: all weights at the extremes of
    their range (-127/127 per channel, -128 too where a backend takes it, int4 -8/7) against
    activations quantized to 127/-128 (255/0 as x86 u8), at a length where a saturating int16 pair
    sum (VPMADDUBSW without VNNI) would be off by half. A kernel that clips any partial sum fails."""
    skip_unless_backend(backend)
    n, k = 48, 512
    scheme = next(s for s, names in quant.BACKENDS.items() if backend in names)
    if backend == "w6a8_native":  # W8 layers whose values fit 6 bits, in groups
        ranges, groups = [(-32, 31)], [16, 32]
    elif backend == "w5a8_native":  # W8 layers whose values fit 5 bits, in groups of 32 or more
        ranges, groups = [(-16, 15)], [32, 64]
    elif scheme == "w8a8":
        group = 32 if backend == "w8a8_native" else k  # only the native kernel takes W8 groups (and -128)
        lo = -128 if backend == "w8a8_native" else -127
        ranges, groups = [(lo, 127)], [group]
    else:
        ranges, groups = [(-8, 7)], [32, k] if backend == "w4a8_dynquant" else [32]
    for lo, hi in ranges:
        for group in groups:
            assert quant.backend_valid(backend, scheme, n, k, group)
            for i, qw in enumerate(_extreme_weights(n, k, lo, hi)):
                s = torch.full((n, k // group), 0.01 * (1 + i))
                zp = torch.zeros_like(s) if scheme == "w4a8" else None
                assert_matches_reference(backend, qw, s, zp, _extreme_activations(k))
