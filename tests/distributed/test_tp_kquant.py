"""GGUF K-quant layers sharded over two ranks (gloo on loopback) keep the file's own scales
(``lowbit.pack_kquant``): the weight loader cuts each rank's part of the ``KQuantScales`` tables with
its rows (column-parallel) or with its inputs (row-parallel). A row-parallel rank whose inputs cut a
super-block of 256 (128 inputs a rank; or 384, rank 1 starting half-way through one) holds finer
super-blocks (``gcd(256, k)``), each with its file super-block's ``d``/``dmin``.

What is checked: each rank's packed layer is a K-quant pack (``"kf"``, at the expected super-block)
whose weights, read back, are exactly the unsharded layer's rows / columns (both read back from a
K-quant pack: bit for bit); column-parallel outputs are the unsharded layer's rows (the same rows,
the same per-token activation codes: within 1e-6 of the output scale); row-parallel outputs are the
sum of each rank's fp64 reference of the kernel's math (``helpers.kquant_reference``, 2e-5 of the output
scale, as for one layer) and within the A8 rounding of the unsharded layer (2% of the output scale)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_files import random_blocks
from helpers import kquant_reference
from tp_harness import Ranks

from appliance.layers import parallel
from appliance.layers.linear import Linear
from appliance.layers.quant import QuantLinear
from appliance.layers.weight_loading import QuantizedWeight
from appliance.models.gguf_quants import canonical
from appliance.ops import native

pytestmark = pytest.mark.skipif(not native.is_available(), reason="the native kernels are not built")

# types -> (the canonical scheme's QuantLinear group, the low-bit method that keeps its scales)
_LAYER = {"Q4_K": ("w4a8", 32, "w4a8_native"), "Q6_K": ("w8a8", 16, "w6a8_native"),
          "Q2_K": ("w8a8", 16, "w6a8_native"), "Q3_K": ("w8a8", 16, "w6a8_native")}

@pytest.fixture(scope="module")
def ranks():
    return Ranks(2)


def _record(qtype: str, n: int, k: int, seed: int) -> QuantizedWeight:
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, n, k, rng)
    cw = canonical(qtype, raw, n, k)
    return QuantizedWeight(cw.qweight, cw.scale, cw.zero_point, cw.group, cw.scheme, cw.kquant)


def _layer(qtype: str, k: int, n: int, tp: str | None) -> QuantLinear:
    scheme, group, _ = _LAYER[qtype]
    lin = Linear(k, n, tp=tp)
    q = QuantLinear(lin.in_features, lin.out_features, scheme, group, w8_groups=scheme == "w8a8")
    parallel.inherit(q, lin)
    return q


def _loaded(lay: QuantLinear, rec: QuantizedWeight) -> QuantLinear:
    lay.weight_loader(lay.qweight, rec, None)
    lay.__dict__["_canonical"] = lay.qweight.data.clone()  # for the reference, before packing releases it
    lay.__dict__["_tables"] = lay.kquant_tables()
    backend = lay.preferred_backend() or _LAYER["Q4_K" if lay.scheme == "w4a8" else "Q6_K"][2]
    lay.set_backend(backend)
    return lay


def _weights(lay: QuantLinear) -> torch.Tensor:
    return lay.method.dequantize_rows(lay.packed, torch.arange(lay.out_features))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q2_K"])
def test_column_parallel_ranks_hold_their_rows_k_quant_scales(ranks, qtype):
    n, k = 64, 512
    rec = _record(qtype, n, k, 1)
    full = _loaded(_layer(qtype, k, n, None), rec)
    assert "kf" in full.packed
    layers = ranks.build(lambda r: _layer(qtype, k, n, "column"))
    for lay in layers:
        _loaded(lay, rec)
        assert lay.backend == _LAYER[qtype][2] and "kf" in lay.packed, (lay.backend, list(lay.packed))
    w = _weights(full)
    for r, lay in enumerate(layers):
        assert torch.equal(_weights(lay), w[r * n // 2:(r + 1) * n // 2])
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    want = full(x)
    for r, got in enumerate(ranks.run(lambda r: layers[r](x))):
        part = want[:, r * n // 2:(r + 1) * n // 2]
        torch.testing.assert_close(got, part, atol=1e-6 * want.abs().max().item(), rtol=0)


def _row_reference(layers, parts) -> torch.Tensor:
    return sum(kquant_reference(p, lay.__dict__["_canonical"], lay.__dict__["_tables"])
               for lay, p in zip(layers, parts))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q3_K", "Q2_K"])
@pytest.mark.parametrize("k,held_super", [(1024, 256), (256, 128), (768, 128)],
                         ids=["whole_super_blocks", "half_a_super_block", "rank1_starts_mid_block"])
def test_row_parallel_ranks_hold_their_inputs_k_quant_scales(ranks, qtype, k, held_super):
    n = 48
    rec = _record(qtype, n, k, 3)
    full = _loaded(_layer(qtype, k, n, None), rec)
    assert full.packed["super"] == 256
    layers = ranks.build(lambda r: _layer(qtype, k, n, "row"))
    for lay in layers:
        _loaded(lay, rec)
        assert lay.backend == _LAYER[qtype][2] and "kf" in lay.packed and lay.packed["super"] == held_super
    w = _weights(full)
    for r, lay in enumerate(layers):
        assert torch.equal(_weights(lay), w[:, r * k // 2:(r + 1) * k // 2])
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    parts = [x[:, r * k // 2:(r + 1) * k // 2] for r in range(2)]
    ref = _row_reference(layers, parts)
    unsharded = full(x)
    for got in ranks.run(lambda r: layers[r](parts[r])):
        assert (got.double() - ref).abs().max().item() <= 2e-5 * ref.abs().max().item()
        torch.testing.assert_close(got, unsharded, atol=0.02 * unsharded.abs().max().item(), rtol=0)
