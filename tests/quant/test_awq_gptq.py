"""AWQ and GPTQ 4-bit checkpoints, packed here in numpy from a tiny random Llama (the layouts are
documented in appliance/models/awq_gptq.py), held against the unpacking reference ``(u - z) * s``:
each loaded weight exactly, each layer's output per method against the fp64 product, and greedy
tokens against the same model carrying the dequantized weights in float."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from appliance import LLM, SamplingParams
from appliance.errors import ModelLoadError
from appliance.layers.linear import host_problem
from appliance.layers.quant import QuantLinear, dequantize
from appliance.models.awq_gptq import AWQ_ORDER
from appliance.models.loader import load, model_info

CPU = torch.device("cpu")
GROUP = 128
KW = {"dtype": "float32", "num_kv_blocks": 32, "max_model_len": 128}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
IDS = list(range(3, 40))
FORMATS = [("awq", False), ("gptq", True), ("gptq", False)]  # (method, sym)


def _quantize(w: np.ndarray, sym: bool):
    """[N, K] float -> (u uint8 [N, K] in [0, 15], z int [N, K/g], s fp16 [N, K/g]), round to nearest."""
    n, k = w.shape
    wg = w.reshape(n, k // GROUP, GROUP).astype(np.float64)
    if sym:
        s = (np.abs(wg).max(-1) / 7).astype(np.float16)
        z = np.full(s.shape, 8)
    else:
        mn, mx = wg.min(-1), wg.max(-1)
        s = ((mx - mn) / 15).astype(np.float16)
        z = np.clip(np.round(-mn / s.astype(np.float64)), 0, 15).astype(np.int64)
    u = np.clip(np.round(wg / s[..., None].astype(np.float64)) + z[..., None], 0, 15).astype(np.uint8)
    return u.reshape(n, k), z, s


def _pack(v: np.ndarray, axis: int, order=range(8)) -> np.ndarray:
    """4-bit values -> int32, eight per int32 along ``axis``: slot j of group i holds element 8i + order[j]."""
    v = np.moveaxis(v.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)[..., list(order)]
    packed = (v << (np.arange(8, dtype=np.uint32) * 4)).sum(-1, dtype=np.uint32)
    return np.ascontiguousarray(np.moveaxis(packed, -1, axis)).view(np.int32)  # save_file writes raw memory


def _write(src, dst, method: str, sym: bool):
    """(quantized checkpoint dir, float dir holding its dequantized weights)."""
    shutil.copytree(src, dst)
    ref = dst.parent / f"{dst.name}-ref"
    shutil.copytree(src, ref)
    tensors = load_file(str(src / "model.safetensors"))
    out, deq = {}, {}
    for name, w in tensors.items():
        if not (name.endswith("_proj.weight") and ".layers." in name):
            out[name] = deq[name] = w
            continue
        base = name[: -len(".weight")]
        u, z, s = _quantize(w, sym)
        deq[name] = ((u.reshape(*z.shape, GROUP).astype(np.float64) - z[..., None]) *
                     s.astype(np.float64)[..., None]).reshape(w.shape).astype(np.float32)
        k = w.shape[1]
        if method == "awq":  # qweight [K, N/8], qzeros [K/g, N/8]: packed along N in AWQ_ORDER
            out[f"{base}.qweight"] = _pack(u.T, 1, AWQ_ORDER)
            out[f"{base}.qzeros"] = _pack(z.T, 1, AWQ_ORDER)
        else:  # qweight [K/8, N] along K; qzeros [K/g, N/8] along N, storing z - 1 (v1)
            out[f"{base}.qweight"] = _pack(u.T, 0)
            out[f"{base}.qzeros"] = _pack((z.T - 1) & 0xF, 1)
            out[f"{base}.g_idx"] = (np.arange(k) // GROUP).astype(np.int32)
        out[f"{base}.scales"] = np.ascontiguousarray(s.T)
    save_file(out, str(dst / "model.safetensors"))
    save_file(deq, str(ref / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    if method == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": sym, "desc_act": False,
              "damp_percent": 0.01, "true_sequential": True}
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, ref


@pytest.fixture(scope="module")
def base_dir(tiny_model_dir):
    return tiny_model_dir("llama", hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module", params=FORMATS, ids=[f"{m}-{'sym' if s else 'asym'}" for m, s in FORMATS])
def ckpt(request, base_dir, tmp_path_factory):
    method, sym = request.param
    return _write(base_dir, tmp_path_factory.mktemp(method) / "q", method, sym)


def _w4_backends():
    return [b for b in ("w4a16_int4pack", "w4a8_dynquant") if host_problem(b, torch.float32, CPU) is None]


def test_weights_equal_the_unpacking_reference_and_layer_outputs(ckpt):
    qdir, ref = ckpt
    model = load(model_info(qdir), torch.float32, CPU)
    want = dict(load(model_info(ref), torch.float32, CPU).named_modules())
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 4
    torch.manual_seed(0)
    for name, m in layers:
        assert m.group_size == GROUP and m.scheme == "w4a8"
        w = want[name].weight.data.double()
        assert torch.equal(dequantize(m.qweight, m.weight_scale, m.weight_zero_point), w), name
        x = torch.randn(5, m.in_features)
        y_ref = x.double() @ w.T
        for b in _w4_backends():
            q = QuantLinear(m.in_features, m.out_features, "w4a8", GROUP)
            for p in ("qweight", "weight_scale", "weight_zero_point"):
                getattr(q, p).data = getattr(m, p).data.clone()
            q.set_backend(b)
            tol = 0.05 if b == "w4a8_dynquant" else 0.02  # int8 / bf16 activations
            torch.testing.assert_close(q(x).double(), y_ref, atol=tol * y_ref.abs().max().item(), rtol=0)


def test_greedy_tokens_equal_the_dequantized_model(ckpt):
    qdir, ref = ckpt
    want = [o.outputs[0].token_ids for o in LLM(str(ref), linear_backend="torch", **KW).generate(
        [IDS[:9], IDS[5:30]], GREEDY)]
    got = [o.outputs[0].token_ids for o in LLM(str(qdir), linear_backend="w4a16_int4pack", **KW).generate(
        [IDS[:9], IDS[5:30]], GREEDY)]
    assert got == want


def _edit(qdir, tmp_path, qc_edit=None, tensor_edit=None):
    d = tmp_path / "bad"
    shutil.copytree(qdir, d)
    if qc_edit:
        cfg = json.loads((d / "config.json").read_text())
        qc_edit(cfg["quantization_config"])
        (d / "config.json").write_text(json.dumps(cfg))
    if tensor_edit:
        t = load_file(str(d / "model.safetensors"))
        tensor_edit(t)
        save_file(t, str(d / "model.safetensors"))
    return d


L0 = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("qc_edit,tensor_edit,words", [
    (lambda q: q.update(bits=8), None, ["quantization_config.bits", "must be 4", "config.json"]),
    (lambda q: q.update(group_size=48), None, [f"{L0}.weight", "group size 48", "does not divide"]),
    (lambda q: q.update(group_size=64), None, [".qzeros' is torch.int32", "group_size 64", "model.safetensors"]),
    (None, lambda t: t.pop(f"{L0}.qzeros"), [f"{L0}.qzeros", "missing", "model.safetensors"]),
    (None, lambda t: t.update({f"{L0}.scales": t[f"{L0}.scales"][:, :8]}), [f"{L0}.scales", "expected"]),
    (None, lambda t: t.update({f"{L0}.qweight": t[f"{L0}.qweight"].view(np.float32)}), [f"{L0}.qweight", "int32"]),
])
def test_config_disagreeing_with_tensors_names_file_and_tensor(ckpt, tmp_path, qc_edit, tensor_edit, words):
    qdir, _ = ckpt
    with pytest.raises(ModelLoadError) as e:
        LLM(str(_edit(qdir, tmp_path, qc_edit, tensor_edit)), **KW)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_act_order_is_refused_naming_desc_act(ckpt, tmp_path):
    qdir, _ = ckpt
    with pytest.raises(ModelLoadError, match="desc_act"):
        LLM(str(_edit(qdir, tmp_path, lambda q: q.update(quant_method="gptq", desc_act=True))), **KW)
