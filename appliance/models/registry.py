"""Architecture name -> model class (rule 7)."""
from __future__ import annotations

from pathlib import Path

from torch import nn

from appliance.errors import ModelLoadError
from appliance.models import gemma, llama, moe

# each family module names its architectures (ARCHS) and builds a model from an HF config (build)
_FAMILIES = (llama, gemma, moe)
_REGISTRY = {name: mod for mod in _FAMILIES for name in mod.ARCHS}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def turn_end_tokens(architecture: str) -> tuple[str, ...]:
    """Tokens (by text) that end a chat turn in this family and stop generation like EOS, whether or not
    the checkpoint's generation_config lists them (Gemma's ``<end_of_turn>``): the family module's
    ``TURN_END_TOKENS``."""
    return tuple(getattr(_REGISTRY.get(architecture), "TURN_END_TOKENS", ()))


def resolve_architecture(hf_config: dict, source: Path) -> str:
    archs = hf_config.get("architectures") or []
    for a in archs:
        if a in _REGISTRY:
            return a
    raise ModelLoadError(
        f"{source}: unsupported architecture {archs or hf_config.get('model_type')!r}; "
        f"supported: {', '.join(supported_architectures())}")


def pooling_architecture(architecture: str) -> str | None:
    """The architecture a model runs as under ``--runner pooling``: itself when it is a pooling one (a
    bare ``*Model`` without lm_head), else its family's ``*Model`` for a ``*ForCausalLM`` (the
    checkpoint's lm_head is then not loaded), else None (no pooling form)."""
    mod = _REGISTRY.get(architecture)
    if mod is None:
        return None
    if getattr(mod.ARCHS[architecture], "pooling", False):
        return architecture
    base = architecture.replace("ForCausalLM", "Model")
    spec = _REGISTRY.get(base) and _REGISTRY[base].ARCHS[base]
    return base if getattr(spec, "pooling", False) else None


def is_pooling_architecture(architecture: str) -> bool:
    return pooling_architecture(architecture) == architecture


def build_model(architecture: str, hf_config: dict) -> nn.Module:
    return _REGISTRY[architecture].build(architecture, hf_config)


def tensor_parallel_architectures() -> list[str]:
    """Architectures whose family module shards over tensor-parallel ranks (``supports_tensor_parallel``)."""
    return sorted(a for a, m in _REGISTRY.items() if getattr(m, "supports_tensor_parallel", False))


def family_config(architecture: str, hf_config: dict):
    """The family's parsed config of ``hf_config`` (``LlamaConfig`` for llama.py's architectures; a
    family module with its own config class says how through ``parse_config``)."""
    mod = _REGISTRY[architecture]
    if hasattr(mod, "parse_config"):  # moe.py
        return mod.parse_config(architecture, hf_config)
    cls = getattr(mod, "FAMILY_CONFIG", None) or mod.LlamaConfig  # gemma.py: GemmaConfig
    return cls.from_hf(hf_config, mod.ARCHS[architecture])


def check_tp_sizes(architecture: str, hf_config: dict, tp: int) -> None:
    """The family's refusal of a tensor-parallel size its sizes do not split by (``check_tp_sizes``)."""
    _REGISTRY[architecture].check_tp_sizes(family_config(architecture, hf_config), tp)
