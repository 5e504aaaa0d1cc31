"""Pre-quantized checkpoints: `appliance convert` round trip, a compressed-tensors checkpoint written
here in the published layout, and quantization configs that must be refused with the field named."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import engine_logits, first_usable_backend, skip_unless_backend
from safetensors.torch import load_file, save_file

from appliance import LLM, SamplingParams
from appliance.convert import run_convert
from appliance.errors import ModelLoadError
from appliance.layers.quant import QuantLinear

IDS = list(range(3, 40))
KW = {"dtype": "float32", "num_kv_blocks": 32, "max_model_len": 128}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _greedy(llm):
    return [o.outputs[0].token_ids for o in llm.generate([IDS[:9], IDS[5:30]], GREEDY)]


@pytest.mark.parametrize("scheme,backend", [("w8a8", "w8a8_onednn"), ("w8a8", "w8a16_int8pack"), ("w8a8", "w8a8_native"),
                                            ("w4a8", "w4a8_dynquant"), ("w4a8", "w4a16_int4pack")])
def test_convert_round_trip_identical(tiny_model_dir, tmp_path, scheme, backend):
    skip_unless_backend(backend)
    src = tiny_model_dir("qwen2")  # q/k/v biases ride along unquantized
    fly = LLM(str(src), quantization=scheme, linear_backend=backend, **KW)
    dst = run_convert(src, tmp_path / "q", scheme, 32)
    cfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors"
    assert (dst / "tokenizer.json").is_file()
    loaded = LLM(str(dst), linear_backend=backend, **KW)
    layers = [m for m in loaded.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 4 and {m.backend for m in layers} == {backend}
    assert torch.equal(engine_logits(fly, IDS), engine_logits(loaded, IDS))
    assert _greedy(fly) == _greedy(loaded)


def _published_w8a8(src, dst):
    """RedHatAI/Meta-Llama-3.1-8B-quantized.w8a8's layout, written without appliance code: separate
    q/k/v/gate/up int8 `weight` + `weight_scale` [out, 1]; dynamic per-token activations."""
    shutil.copytree(src, dst)
    tensors = {}
    for f in src.glob("*.safetensors"):
        for name, t in load_file(str(f)).items():
            if name.endswith("_proj.weight"):
                scale = t.float().abs().amax(dim=1, keepdim=True) / 127
                tensors[name] = torch.round(t.float() / scale).clamp(-127, 127).to(torch.int8)
                tensors[name + "_scale"] = scale
            else:
                tensors[name] = t
        (dst / f.name).unlink()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "config_groups": {"group_0": {
            "input_activations": {"actorder": None, "block_structure": None, "dynamic": True, "group_size": None,
                                  "num_bits": 8, "observer": None, "observer_kwargs": {}, "strategy": "token",
                                  "symmetric": True, "type": "int"},
            "output_activations": None, "targets": ["Linear"],
            "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None,
                        "num_bits": 8, "observer": "minmax", "observer_kwargs": {}, "strategy": "channel",
                        "symmetric": True, "type": "int"}}},
        "format": "int-quantized", "global_compression_ratio": 1.46, "ignore": ["lm_head"],
        "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
        "sparsity_config": {}, "version": "0.7.1"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _published_w4a16(src, dst, group=32):
    """compressed-tensors pack-quantized W4A16 (RedHatAI/*-quantized.w4a16): `weight_packed` int32
    [out, in/8] (eight +8-offset nibbles, value j at bits 4j), bf16 `weight_scale` [out, in/group],
    `weight_shape`."""
    shutil.copytree(src, dst)
    tensors = {}
    for f in src.glob("*.safetensors"):
        for name, t in load_file(str(f)).items():
            if name.endswith("_proj.weight"):
                n, k = t.shape
                wg = t.float().reshape(n, k // group, group)
                scale = (wg.abs().amax(-1) / 7).bfloat16()
                q = torch.round(wg / scale.float()[..., None]).clamp(-8, 7).reshape(n, k).to(torch.int32) + 8
                packed = torch.zeros(n, k // 8, dtype=torch.int64)
                for j in range(8):
                    packed |= q[:, j::8].to(torch.int64) << (4 * j)
                packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
                base = name[: -len(".weight")]
                tensors.update({f"{base}.weight_packed": packed, f"{base}.weight_scale": scale,
                                f"{base}.weight_shape": torch.tensor([n, k])})
            else:
                tensors[name] = t
        (dst / f.name).unlink()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                      "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                                                  "group_size": group, "num_bits": 4, "observer": "minmax",
                                                  "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                                                  "type": "int"}}},
        "format": "pack-quantized", "ignore": ["lm_head"], "kv_cache_scheme": None,
        "quant_method": "compressed-tensors", "quantization_status": "compressed"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_published_w8a8_matches_on_the_fly(llama_dir, tmp_path):
    backend = first_usable_backend("w8a8_onednn", "w8a8_native")
    ct = LLM(str(_published_w8a8(llama_dir, tmp_path / "ct")), linear_backend=backend, **KW)
    fly = LLM(str(llama_dir), quantization="w8a8", linear_backend=backend, **KW)
    a, b = engine_logits(ct, IDS), engine_logits(fly, IDS)
    # the same integers and scales up to how the scale is rounded (division vs multiplication)
    torch.testing.assert_close(a, b, atol=1e-4 * b.abs().max().item(), rtol=0)
    assert _greedy(ct) == _greedy(fly)


@pytest.mark.parametrize("backend", ["w4a16_int4pack", "w4a8_dynquant"])
def test_published_w4a16_loads_exactly(llama_dir, tmp_path, backend):
    """Symmetric int4 as published. On-the-fly W4 uses the min/max grid instead (see
    appliance/layers/quant.py), so the check is against the float model carrying the checkpoint's
    dequantized weights: every integer and scale lands where it belongs, fused shards included."""
    from appliance.layers.linear import Linear
    from appliance.layers.quant import dequantize
    from appliance.models.loader import model_info
    from appliance.models.quant_loader import load

    path = _published_w4a16(llama_dir, tmp_path / "ct")
    ct = LLM(str(path), linear_backend=backend, **KW)
    ref = LLM(str(llama_dir), linear_backend="torch", **KW)
    # the canonical form as loaded (the engine's layers keep only their packed weights)
    qmods = dict(load(model_info(path), torch.float32, torch.device("cpu")).named_modules())
    n = 0
    for name, m in ref.engine.runner.model.named_modules():
        if isinstance(m, Linear) and not name.endswith("lm_head"):
            q = qmods[name]
            assert q.group_size == 32 and not q.weight_zero_point.any()
            w = dequantize(q.qweight, q.weight_scale).float()
            # written by the test from the float weights: symmetric, amax / 7 in bf16
            wg = m.weight.reshape(m.out_features, -1, 32)
            s = (wg.abs().amax(-1) / 7).bfloat16().float()
            torch.testing.assert_close(w, (torch.round(wg / s[..., None]).clamp(-8, 7) * s[..., None]).reshape(w.shape))
            m.weight.data = w
            n += 1
    assert n == 2 * 4
    a, b = engine_logits(ct, IDS), engine_logits(ref, IDS)
    tol = 0.05 if backend == "w4a8_dynquant" else 0.02  # int8 activations; bf16 activations
    torch.testing.assert_close(a, b, atol=tol * b.abs().max().item(), rtol=0)


@pytest.fixture(scope="module")
def ct_dir(llama_dir, tmp_path_factory):
    return run_convert(llama_dir, tmp_path_factory.mktemp("ct") / "w8", "w8a8")


def _bad(ct_dir, tmp_path, edit):
    d = tmp_path / "bad"
    shutil.copytree(ct_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg["quantization_config"])
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _weights(q):
    return q["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize("edit,field", [
    (lambda q: q.update(quant_method="gptq"), "quantization_config.quant_method"),
    (lambda q: q.update(format="float-quantized"), "quantization_config.format"),
    (lambda q: q.update(config_groups={}), "quantization_config.config_groups"),
    (lambda q: _weights(q).update(num_bits=3), "quantization_config.config_groups.group_0.weights.num_bits"),
    (lambda q: _weights(q).update(symmetric=False), "quantization_config.config_groups.group_0.weights.symmetric"),  # int8
    (lambda q: _weights(q).update(type="float"), "quantization_config.config_groups.group_0.weights.type"),
    (lambda q: _weights(q).update(strategy="tensor"), "quantization_config.config_groups.group_0.weights.strategy"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
     "quantization_config.config_groups.group_0.input_activations.dynamic"),
    (lambda q: q.update(format="pack-quantized"), "quantization_config.format"),
    (lambda q: q.update(ignore="lm_head"), "quantization_config.ignore"),
])
def test_bad_quantization_config_names_the_field(ct_dir, tmp_path, edit, field):
    with pytest.raises(ModelLoadError) as e:
        LLM(str(_bad(ct_dir, tmp_path, edit)), **KW)
    assert field in str(e.value) and "config.json" in str(e.value)


def test_requantizing_a_quantized_checkpoint_is_refused(ct_dir):
    with pytest.raises(ModelLoadError, match="already quantized"):
        LLM(str(ct_dir), quantization="w4a8", **KW)


def test_bad_quantization_arguments(llama_dir):
    from appliance.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="quantization must be one of none, w8a8, w4a8, gguf; got 'int3'"):
        LLM(str(llama_dir), quantization="int3", **KW)
    with pytest.raises(ModelLoadError, match="quant_group_size=48"):
        LLM(str(llama_dir), quantization="w4a8", quant_group_size=48, **KW)
