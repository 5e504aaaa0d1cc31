"""``appliance convert --quantization w8a8|w4a8 SRC DST``: write a float checkpoint quantized, in the
compressed-tensors layout the loader reads back (see ``appliance/models/quant_loader.py``).

The projections of each decoder layer (``*_proj.weight``) are quantized exactly as at load
(``appliance.layers.quant``: round-to-nearest symmetric int8 per channel, or int4 per group on the
group's min/max grid, bf16-held scales and fp32 zero points); embeddings, norms, biases and ``lm_head`` are copied as they are. Loading
DST therefore gives the same weights, bit for bit, as loading SRC with ``--quantization``.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from appliance.layers.quant import (
    SCHEMES,
    pack_int4_to_int32,
    quantize_int4,
    quantize_int8,
)

_QUANTIZED = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight",
              ".gate_proj.weight", ".up_proj.weight", ".down_proj.weight")


def compressed_tensors_config(quantization: str, group_size: int) -> dict:
    """The ``quantization_config`` of a checkpoint written by ``run_convert``."""
    int8 = quantization == "w8a8"
    weights = {"num_bits": 8 if int8 else 4, "type": "int", "symmetric": int8, "dynamic": False,
               "strategy": "channel" if int8 else "group", "group_size": None if int8 else group_size,
               "actorder": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token",
            "group_size": None, "actorder": None, "block_structure": None, "observer": None, "observer_kwargs": {}}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if int8 else "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": acts, "output_activations": None}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def quantize_tensor(name: str, w: torch.Tensor, quantization: str, group_size: int) -> dict[str, torch.Tensor]:
    """One float projection weight -> its compressed-tensors tensors."""
    base = name[: -len(".weight")]
    if quantization == "w8a8":
        q, s = quantize_int8(w)
        return {f"{base}.weight": q, f"{base}.weight_scale": s}
    q, s, zp = quantize_int4(w, group_size)
    n, k = q.shape
    if k % 8:
        raise ValueError(f"{name}: input size {k} is not a multiple of 8 (int4 packs 8 per int32)")
    # group scales are bf16-exact by construction; channel-wise ones stay fp32
    s = s.to(torch.bfloat16) if s.shape[1] > 1 else s
    # float zero points: each group's exact min/max grid (see appliance/layers/quant.py)
    return {f"{base}.weight_packed": pack_int4_to_int32(q), f"{base}.weight_scale": s,
            f"{base}.weight_zero_point": zp, f"{base}.weight_shape": torch.tensor([n, k], dtype=torch.int64)}


def run_convert(src: str | Path, dst: str | Path, quantization: str, group_size: int = 32) -> Path:
    """Quantize the float Hugging Face checkpoint in ``src`` into ``dst`` (created). Returns ``dst``."""
    from safetensors.torch import save_file

    from appliance.errors import ModelLoadError
    from appliance.models.loader import iter_weights, read_config

    if quantization not in SCHEMES:
        raise ValueError(f"quantization must be one of {', '.join(SCHEMES)}; got {quantization!r}")
    src, dst = Path(src), Path(dst)
    hf = read_config(src)
    if "quantization_config" in hf:
        raise ModelLoadError(f"{src / 'config.json'}: already quantized (quantization_config present)")
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst}: exists and is not empty")
    dst.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    files: list[dict[str, torch.Tensor]] = []
    size, limit = 0, 2 << 30  # ~2 GiB per output file
    for _, name, t in iter_weights(src):
        if "rotary_emb.inv_freq" in name:
            continue
        parts = quantize_tensor(name, t, quantization, group_size) if name.endswith(_QUANTIZED) else {name: t}
        for k, v in parts.items():
            out[k] = v.contiguous()
            size += v.numel() * v.element_size()
        if size > limit:
            files.append(out)
            out, size = {}, 0
    if out:
        files.append(out)
    weight_map = {}
    for i, tensors in enumerate(files):
        fname = "model.safetensors" if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    if len(files) > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    hf = dict(hf, quantization_config=compressed_tensors_config(quantization, group_size))
    (dst / "config.json").write_text(json.dumps(hf, indent=2))
    for f in src.iterdir():  # tokenizer, generation config, chat template, ...
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors") \
                and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    return dst
