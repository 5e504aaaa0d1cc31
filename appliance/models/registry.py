"""Architecture name -> model class (rule 7)."""
from __future__ import annotations

from pathlib import Path

from torch import nn

from appliance.errors import ModelLoadError
from appliance.models import llama, moe

_REGISTRY = {name: llama for name in llama.ARCHS} | {name: moe for name in moe.ARCHS}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def resolve_architecture(hf_config: dict, source: Path) -> str:
    archs = hf_config.get("architectures") or []
    for a in archs:
        if a in _REGISTRY:
            return a
    raise ModelLoadError(
        f"{source}: unsupported architecture {archs or hf_config.get('model_type')!r}; "
        f"supported: {', '.join(supported_architectures())}")


def build_model(architecture: str, hf_config: dict) -> nn.Module:
    mod = _REGISTRY[architecture]
    if hasattr(mod, "build"):  # a family module with its own config reading
        return mod.build(architecture, hf_config)
    cfg = mod.LlamaConfig.from_hf(hf_config, mod.ARCHS[architecture])
    return mod.LlamaForCausalLM(cfg)
