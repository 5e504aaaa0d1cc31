"""Load a Hugging Face model directory: config.json, one or many *.safetensors (with an index),
generation_config.json. Weights are streamed tensor by tensor from mmap'ed safetensors files into a
model built on the meta device, so a checkpoint is never held twice in RAM."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from appliance.errors import ModelLoadError
from appliance.models.registry import resolve_architecture


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    architecture: str
    hf_config: dict
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int


def read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{cfg_file}: missing (a model directory needs config.json)")
    try:
        return json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_file}: not valid JSON ({e})") from e


def _eos_ids(path: Path, hf: dict) -> tuple[int, ...]:
    ids: list[int] = []

    def add(v):
        if v is None:
            return
        for t in (v if isinstance(v, list) else [v]):
            if isinstance(t, int) and t not in ids:
                ids.append(t)

    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            add(json.loads(gen.read_text()).get("eos_token_id"))
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{gen}: not valid JSON ({e})") from e
    add(hf.get("eos_token_id"))
    return tuple(ids)


def model_info(path: Path) -> ModelInfo:
    hf = read_config(path)
    arch = resolve_architecture(hf, path / "config.json")
    return ModelInfo(path, arch, hf, _eos_ids(path, hf), int(hf.get("max_position_embeddings", 2048)))


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from e
        files = [path / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: listed in {index.name} but missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight files")
    return files


def iter_weights(path: Path, skip=lambda name: False):
    """Yield (file, tensor name, tensor) from every safetensors file, one tensor at a time; tensors
    whose name ``skip`` accepts are never read."""
    for f in safetensors_files(path):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    if not skip(name):
                        yield f, name, st.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ModelLoadError(f"{f}: cannot read safetensors file ({type(e).__name__}: {e})") from e


def load_model(info: ModelInfo, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from appliance.models.registry import build_model

    with torch.device("meta"):
        model = build_model(info.architecture, info.hf_config)
    model = model.to(dtype=dtype).to_empty(device=device)
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {}
    for f, name, tensor in iter_weights(info.path):
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and "lm_head.weight" not in params:
            continue  # tied embeddings: the checkpoint may still carry a copy
        pname, shard = model.param_for(name)
        p = params.get(pname)
        if p is None:
            raise ModelLoadError(f"{f}: unexpected tensor {name!r} for {info.architecture}")
        dst = p.data
        if shard is not None:
            offset, rows = model.get_submodule(pname.rsplit(".", 1)[0]).shards[shard]
            dst = dst.narrow(0, offset, rows)
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ModelLoadError(
                f"{f}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)} "
                f"from config.json")
        dst.copy_(tensor)
        loaded.setdefault(pname, set()).add(shard)
    check_complete(model, params, loaded, info.path)
    model.eval()
    return model


def check_complete(model, params, loaded: dict[str, set], path: Path, optional=lambda name: False) -> None:
    """Every parameter (and every shard of a fused one) got a checkpoint tensor, else ModelLoadError
    naming what is missing. ``optional(name)`` exempts parameters a format may leave out."""
    missing = []
    for pname in params:
        shards = getattr(model.get_submodule(pname.rsplit(".", 1)[0]), "shards", None)
        want = set(shards) if shards else {None}
        if not want <= loaded.get(pname, set()) and not optional(pname):
            missing.append(pname)
    if missing:
        raise ModelLoadError(f"{path}: checkpoint lacks tensors for {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
