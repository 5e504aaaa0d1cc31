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
    assert linear.share_of_probe_rows(2 / 8) == (1, 8, 64)
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
