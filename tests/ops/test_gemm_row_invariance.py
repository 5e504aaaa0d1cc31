"""--batch-invariant takes a linear method only where a row's output is the same bits whatever the other
rows are and however many there are (``LinearMethod.row_invariant``). Here every such method, packed for
it (``row_invariant_pack``), in every kernel variant this CPU runs (AVX512 and AVX512-BF16 where CI's host
has them; NEON, SVE and BFDOT rows are checked under qemu by the harness, tests/arm64): each row of a batch
of M rows equals the row computed alone and in a batch of another size, at the row counts where the
kernels change their blocking (1-4 rows one way, pairs, 8-row blocks) and past the native float GEMM's
prefill limit (NATIVE_F32_MAX_ROWS), which the packing gives up. The methods that are not row-invariant
say so (a W8 layer with zero points: torch's addmm adds their term)."""
from __future__ import annotations

import pytest
import torch

from appliance.layers import methods, quant
from appliance.layers.methods import floating

ROWS = (2, 3, 4, 5, 7, 8, 17, floating.NATIVE_F32_DEFAULT_MAX_ROWS + 6)
N, K = 72, 256


def _packed(name: str, g: torch.Generator) -> dict:
    m = methods.get(name)
    w = torch.randn(N, K, generator=g) * 0.05
    if name == "native":
        return m.row_invariant_pack(m.pack(w, torch.randn(N, generator=g)))
    if name == "native_bf16":
        return m.row_invariant_pack(m.pack(w.bfloat16(), None))
    if name == "w8a8_native":
        q, s = quant.quantize_int8(w)
        return m.row_invariant_pack(m.pack(q, s, None))
    if name == "w6a8_native":  # values within 6 bits
        q, s = quant.quantize_int8(w)
        return m.row_invariant_pack(m.pack((q // 4).to(torch.int8), s * 4, None))
    if name == "w5a8_native":  # values within 5 bits, groups of 32
        q, s = quant.quantize_int8(w)
        q = (q // 8).to(torch.int8)
        return m.row_invariant_pack(m.pack(q, (s * 8).expand(N, K // 32).contiguous(), None))
    q, s, zp = quant.quantize_int4(w, 32)  # w4a8_native: groups of 32 with zero points (in-kernel offsets)
    return m.row_invariant_pack(m.pack(q, s, zp))


INVARIANT = [n for n, m in methods.REGISTRY.items() if m.row_invariant]


def test_the_row_invariant_methods_are_the_native_kernels():
    assert sorted(INVARIANT) == ["native", "native_bf16", "w4a8_native", "w5a8_native", "w6a8_native", "w8a8_native"]


@pytest.mark.parametrize("name", INVARIANT)
def test_rows_equal_alone_and_in_any_batch(variant, name):
    m = methods.get(name)
    if m.host_problem(torch.bfloat16 if name == "native_bf16" else torch.float32) is not None:
        pytest.fail(f"{name} cannot run here: {m.host_problem()}")  # the native extension is built (conftest)
    g = torch.Generator().manual_seed(hash(name) % 2**31)
    p = _packed(name, g)
    dtype = torch.bfloat16 if name == "native_bf16" else torch.float32
    x = (torch.randn(max(ROWS), K, generator=g) * 2).to(dtype)
    x[3, :5] = 40.0  # a row whose activation range is far from the others' (per-token quantization)
    alone = torch.cat([m.apply(p, x[i:i + 1]) for i in range(max(ROWS))])
    for rows in ROWS:
        for start in (0, max(ROWS) - rows):
            got = m.apply(p, x[start:start + rows])
            assert torch.equal(got, alone[start:start + rows]), (variant, name, rows, start)


def test_the_methods_that_are_not_say_so():
    w8 = methods.get("w8a8_native")
    q, s, zp = quant.quantize_int4(torch.randn(32, 64), 32)
    assert w8.row_invariant_pack(w8.pack(q, s, zp)) is None  # zero points: torch's addmm
    for name in ("torch", "onednn", "w8a8_onednn", "w4a8_dynquant", "w8a16_int8pack", "w4a16_int4pack"):
        assert not methods.get(name).row_invariant, name
