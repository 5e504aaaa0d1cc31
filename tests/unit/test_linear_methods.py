"""The linear-method registry: one class per backend, found by name, kept equal to the config's
list of names; a method is a candidate only where its host_problem is None, and refused by name
with that reason otherwise."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from appliance.config import LINEAR_BACKENDS
from appliance.errors import InvalidRequestError
from appliance.layers import linear, methods, quant
from appliance.layers.methods.floating import FloatMethod

CPU = torch.device("cpu")


def test_registry_and_config_name_the_same_methods():
    assert set(methods.REGISTRY) == set(LINEAR_BACKENDS) - {"auto"}
    assert all(name == m.name for name, m in methods.REGISTRY.items())
    assert linear.FLOAT_BACKENDS == ("torch", "onednn", "native", "native_bf16")
    assert quant.BACKENDS == {"w8a8": ("w8a8_onednn", "w8a16_int8pack", "w8a8_native", "w6a8_native", "w5a8_native"),
                              "w4a8": ("w4a8_dynquant", "w4a16_int4pack", "w4a8_native")}


@pytest.mark.parametrize("name", LINEAR_BACKENDS[1:])
def test_every_method_says_why_it_cannot_run_or_none(name):
    m = methods.get(name)
    assert m.scheme in methods.SCHEMES
    for dtype in (torch.float32, torch.bfloat16):
        why = m.host_problem(dtype, CPU)
        assert why is None or (isinstance(why, str) and why)
        assert linear.host_problem(name, dtype, CPU) == why


def test_only_float_methods_join_the_decoder_stack_with_distinct_kinds():
    kinds = {m.name: m.fused_kind for m in methods.REGISTRY.values() if m.fused_kind is not None}
    assert kinds == {"native": 0, "onednn": 1, "torch": 2, "native_bf16": 7}  # LinearKind in torch_bindings.cpp


class _Fake(FloatMethod):
    name = "fake"
    problem: str | None = None

    def host_problem(self, dtype=torch.float32, device=CPU):
        return self.problem

    def pack(self, weight, bias, silu_mul=False):
        return {"w": weight.detach().clone(), "bias": bias}

    def apply(self, p, x):
        return F.linear(x, p["w"], p["bias"])


@pytest.fixture
def fake(monkeypatch):
    m = _Fake()
    monkeypatch.setitem(methods.REGISTRY, "fake", m)
    return m


def _layer() -> linear.Linear:
    lin = linear.Linear(64, 32, bias=True)
    lin.weight.data = torch.randn(32, 64)
    lin.bias.data = torch.randn(32)
    return lin


def test_a_registered_method_is_a_candidate_and_runs(fake):
    lin = _layer()
    assert "fake" in lin.candidates(torch.float32, CPU)
    x = torch.randn(3, 64)
    want = lin(x)
    assert linear.select_backends(nn.Sequential(lin), "fake", torch.float32, CPU) == {"64x32": "fake"}
    assert lin.backend == "fake" and lin.method is fake
    torch.testing.assert_close(lin(x), want)
    assert lin.weight.numel() == 0  # a packing method releases the checkpoint layout
    assert lin.fused_descriptor() is None  # no LinearKind: the per-op path


def test_a_method_with_a_host_problem_is_withdrawn_and_refused_by_name(fake):
    fake.problem = "the fake kernel needs a CPU feature this test says is missing"
    lin = _layer()
    assert "fake" not in lin.candidates(torch.float32, CPU)
    with pytest.raises(InvalidRequestError) as e:
        linear.select_backends(nn.Sequential(lin), "fake", torch.float32, CPU)
    msg = str(e.value)
    assert "linear_backend=fake " in msg and fake.problem in msg and "Available here: " in msg


def test_unknown_names_are_refused():
    with pytest.raises(InvalidRequestError, match="linear_backend must be one of"):
        linear.select_backends(nn.Sequential(_layer()), "nope", torch.float32, CPU)
    with pytest.raises(ValueError, match="unknown quantized backend 'torch'"):
        quant.pack("torch", torch.zeros(16, 32, dtype=torch.int8), torch.ones(16, 1))


def test_a_layer_with_its_own_probe_rows_is_timed_and_kept_apart(monkeypatch, tmp_path):
    """A layer with ``probe_rows`` (a mixture-of-experts expert) is timed at those batch sizes, and its
    choice is kept apart from the same shape timed at the step's sizes (in the choice cache and in the
    summary): the two get the backend each one's own timing says."""
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path))
    cands = linear.float_candidates(torch.float32, CPU)
    if len(cands) < 2:
        pytest.skip(f"one float linear method on this host ({cands}): nothing to choose between")
    calls = []

    def fake_measure(self, candidates, rows, timer):
        calls.append((self.shape_key, tuple(rows)))
        # the step's sizes favour the first candidate, the expert's sizes the last
        order = candidates if tuple(rows) == linear._PROBE_ROWS else candidates[::-1]
        return {c: float(i) for i, c in enumerate(order)}

    monkeypatch.setattr(linear.Linear, "measure", fake_measure)
    step, expert = _layer(), _layer()
    expert.probe_rows = linear.share_of_probe_rows(8 / 128)
    assert expert.probe_rows == (1, 2, 16)
    got = linear.select_backends(nn.Sequential(step, expert), "auto", torch.float32, CPU)
    assert got == {"64x32": cands[0], "64x32 rows 1,2,16": cands[-1]}
    assert (step.backend, expert.backend) == (cands[0], cands[-1])
    assert sorted(calls) == [("32x64", (1, 2, 16)), ("32x64", linear._PROBE_ROWS)]  # shape_key: out x in
    # a second model reads both choices from the cache
    assert linear.select_backends(nn.Sequential(_layer(), expert2 := _layer()), "auto", torch.float32, CPU) == {
        "64x32": cands[0]}
    expert2.probe_rows = (1, 2, 16)
    assert linear.select_backends(nn.Sequential(expert2), "auto", torch.float32, CPU) == {"64x32 rows 1,2,16": cands[-1]}
    assert len(calls) == 2


def test_share_of_probe_rows_is_at_least_one_row():
    assert linear.share_of_probe_rows(1.0) == linear._PROBE_ROWS
    assert linear.share_of_probe_rows(2 / 8) == (1, 4, 8, 64)
    assert linear.share_of_probe_rows(1 / 1000) == (1,)


def test_a_gate_up_timed_with_its_silu_is_kept_apart_from_the_same_shape_without(monkeypatch, tmp_path):
    """A [gate; up] projection (``silu_mul_next``: timed with its silu_and_mul, which the native method
    fuses) and a layer of the same shape timed without it (Gemma's GeGLU projection) are chosen apart:
    neither model reuses the other's choice from the cache."""
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path))
    cands = linear.float_candidates(torch.float32, CPU)
    if len(cands) < 2:
        pytest.skip(f"one float linear method on this host ({cands}): nothing to choose between")
    calls = []

    def fake_measure(self, candidates, rows, timer):
        calls.append(self.silu_mul_next)
        order = candidates[::-1] if self.silu_mul_next else candidates
        return {c: float(i) for i, c in enumerate(order)}

    monkeypatch.setattr(linear.Linear, "measure", fake_measure)
    geglu = _layer()
    linear.select_backends(nn.Sequential(geglu), "auto", torch.float32, CPU)
    swiglu = _layer()
    swiglu.silu_mul_next = True
    linear.select_backends(nn.Sequential(swiglu), "auto", torch.float32, CPU)
    assert (geglu.backend, swiglu.backend) == (cands[0], cands[-1])
    assert calls == [False, True]


@pytest.mark.parametrize("n,k,bias", [(96, 64, True), (100, 72, False), (49, 64, True)])
def test_native_f32_takes_prefill_rows_through_a_batched_gemm_over_its_panels(n, k, bias, monkeypatch):
    """``native`` float32: up to ``NATIVE_F32_MAX_ROWS`` rows the panel kernel, above them torch's
    batched GEMM over the same packed panels (the panel kernel has no blocking over rows: 3-6x slower
    than a cache-blocked GEMM at prefill sizes, so ``auto`` never chose it for a float model and batch-1
    decode lost its fastest kernel). Both against the fp64 reference, output widths not a multiple of
    the 32-column panel, a 3-D x; the kernel is called exactly for the small row counts."""
    from appliance.layers.methods import floating
    from appliance.ops import native

    m = methods.get("native")
    if m.host_problem(torch.float32, CPU):
        with pytest.raises(ValueError, match="native"):
            m.pack(torch.zeros(n, k), None)
        return
    limit = floating.NATIVE_F32_MAX_ROWS
    kernel_rows = []
    real = native.gemm_f32
    monkeypatch.setattr(native, "gemm_f32", lambda x, *a, **kw: kernel_rows.append(x.shape[0]) or real(x, *a, **kw))
    torch.manual_seed(0)
    w, b = torch.randn(n, k), (torch.randn(n) if bias else None)
    p = m.pack(w, b)
    for shape in [(1, k), (limit, k), (limit + 1, k), (256, k), (3, 40, k)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(m.apply(p, x).double(), m.reference(x, w, b), atol=1e-4, rtol=1e-5)
    assert kernel_rows == [1, limit]


def test_native_f32_silu_mul_above_the_kernel_rows_matches_the_reference(monkeypatch):
    """The [gate; up] projection packed for the silu epilogue (rows interleaved 16 gate / 16 up per
    panel): above ``NATIVE_F32_MAX_ROWS`` rows ``apply_silu_mul`` undoes the interleave itself and
    gives silu(gate) * up in the checkpoint's column order, as the kernel's epilogue does below it."""
    from appliance.layers.methods import floating

    m = methods.get("native")
    if m.host_problem(torch.float32, CPU):
        pytest.skip(f"native: {m.host_problem(torch.float32, CPU)} (its refusal: the test above)")
    inter, k = 64, 48
    torch.manual_seed(1)
    w, b = torch.randn(2 * inter, k), torch.randn(2 * inter)
    p = m.pack(w, b, silu_mul=True)
    assert m.fused_silu_mul(p)
    for rows in (1, floating.NATIVE_F32_MAX_ROWS, floating.NATIVE_F32_MAX_ROWS + 1, 200):
        x = torch.randn(rows, k)
        ref = m.reference(x, w, b)
        want = F.silu(ref[:, :inter]) * ref[:, inter:]
        torch.testing.assert_close(m.apply_silu_mul(p, x).double(), want, atol=2e-4, rtol=1e-5)
        torch.testing.assert_close(m.apply(p, x).double(), ref, atol=1e-4, rtol=1e-5)


def test_a_choice_timed_before_a_method_changed_is_timed_again(monkeypatch, tmp_path):
    """A method's ``revision`` is in the choice's key: a choice cached while ``native`` ran prefill rows
    through its panel kernel (revision 0, which always lost there) is not reused once it changed."""
    import json

    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path))
    cands = linear.float_candidates(torch.float32, CPU)
    if "native" not in cands:
        pytest.skip(f"no native float32 method on this host ({cands})")
    assert methods.get("native").revision >= 1
    calls = []

    def fake_measure(self, candidates, rows, timer):
        calls.append(1)
        return {c: (0.0 if c == "native" else 1.0) for c in candidates}

    monkeypatch.setattr(linear.Linear, "measure", fake_measure)
    lin = _layer()
    linear.select_backends(nn.Sequential(lin), "auto", torch.float32, CPU)
    cache = json.loads((tmp_path / "linear_backends.json").read_text())
    (key,) = cache
    assert "native@r" in key and cache[key] == "native"
    # the same entry as an older build wrote it (no revision in the key), choosing another method
    stale = {key.replace(f"native@r{methods.get('native').revision}", "native"): "torch"}
    (tmp_path / "linear_backends.json").write_text(json.dumps(stale))
    lin2 = _layer()
    linear.select_backends(nn.Sequential(lin2), "auto", torch.float32, CPU)
    assert lin2.backend == "native" and len(calls) == 2
