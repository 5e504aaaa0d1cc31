"""Rotary position embedding: the config's RoPE parameters in one normalized form, the inverse
frequencies and attention factor of every scaling this engine implements (default, linear, Llama-3.1
``llama3``, Phi-3 ``longrope``, ``yarn``), and the cos/sin cache built once at load.

The attention factor (longrope, yarn) multiplies cos and sin, so it lives in the cache: every
kernel that reads the cache (reference, native, the fused decoder stack) applies it with no change.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from appliance.errors import ModelLoadError
from appliance.layers.forward_context import current_ops

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
# types that stretch a context trained at original_max_position_embeddings
_NEEDS_ORIGINAL = ("llama3", "longrope", "yarn")


def rope_parameters(hf: dict, aliases: dict[str, str] | None = None) -> dict:
    """The config's RoPE parameters as one dict, as transformers standardizes them: ``rope_type``,
    ``rope_theta``, ``partial_rotary_factor`` and, for the types that need it,
    ``original_max_position_embeddings`` (a top-level config key wins over the dict's, as in
    transformers; else the dict's; else max_position_embeddings), beside the type's own keys.
    Accepts the transformers-5 ``rope_parameters`` and the older ``rope_scaling`` + ``rope_theta``.
    ``aliases``: an architecture's old names for a type (Phi-3's ``su`` for ``longrope``)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    rope_type = (aliases or {}).get(rope_type, rope_type)
    rope["rope_type"] = rope_type
    rope.pop("type", None)
    rope.setdefault("rope_theta", float(hf.get("rope_theta", 10000.0)))
    rope.setdefault("partial_rotary_factor", float(hf.get("partial_rotary_factor", 1.0)))
    if rope_type in _NEEDS_ORIGINAL:
        top = hf.get("original_max_position_embeddings")
        if top is not None:
            rope["original_max_position_embeddings"] = top
        rope.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
    return rope


def rotary_dim(head_dim: int, params: dict) -> int:
    """Dims of each head that are rotated: ``int(head_dim * partial_rotary_factor)``, as transformers."""
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def _inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _llama3_scaling(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = params["factor"]
    low = params.get("low_freq_factor", 1.0)
    high = params.get("high_freq_factor", 4.0)
    old_ctx = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _longrope(rotary_dim: int, theta: float, params: dict, max_position_embeddings: int,
              max_model_len: int) -> tuple[torch.Tensor, float]:
    # Transformers picks short_factor or long_factor per forward call from the current sequence
    # length. A serving engine cannot do that: keys already in the paged cache were rotated with
    # the factors of their time, and a sequence crossing original_max_position_embeddings would
    # mix both. So the choice is made once, from the longest sequence this engine will serve
    # (max_model_len): long factors when it may pass the original context, short ones otherwise
    # (vLLM does the same). Both agree with transformers whenever a whole sequence stays on one
    # side of original_max_position_embeddings.
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = params["long_factor"] if max_model_len > original else params["short_factor"]
    shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta ** shape), float(attention_factor)


def _yarn(rotary_dim: int, theta: float, params: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    # YaRN (Peng et al. 2023): interpolate the low frequencies by `factor`, keep the high ones,
    # ramp linearly between the dims that turn beta_slow and beta_fast times over the original
    # context; cos/sin scaled by 0.1 ln(factor) + 1 (or the mscale ratio DeepSeek configs give).
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a single-dim ramp would divide by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    extrapolate = 1 - ramp  # 1: keep the trained frequency, 0: interpolate by factor
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attention_factor)


def check_rope(params: dict, rotary_dim: int, where: str = "config.json") -> None:
    """Raise ModelLoadError (naming the field and value) for a RoPE this engine does not implement
    or whose parameters do not fit ``rotary_dim``."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        why = (" (dynamic NTK rescales the frequencies per sequence length, which a cache of rotated keys "
               "cannot follow)" if "dynamic" in str(rope_type) else "")
        raise ModelLoadError(f"{where}: rope_scaling.rope_type={rope_type!r} is not supported{why}; "
                             f"supported: {', '.join(ROPE_TYPES)}")
    needed = {"linear": ("factor",), "llama3": ("factor",), "longrope": ("short_factor", "long_factor")}
    for key in needed.get(rope_type, ()):
        if params.get(key) is None:
            raise ModelLoadError(f"{where}: rope_scaling.{key} is missing (rope_type={rope_type!r} needs it)")
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            n = len(params[key])
            if n != rotary_dim // 2:
                raise ModelLoadError(f"{where}: rope_scaling.{key} has {n} values; rotary dim {rotary_dim} "
                                     f"needs {rotary_dim // 2}")
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ModelLoadError(f"{where}: partial_rotary_factor={params.get('partial_rotary_factor')} gives "
                             f"rotary dim {rotary_dim}; it must be even and positive")


def build_inv_freq(rotary_dim: int, theta: float, scaling: dict | None, max_position_embeddings: int | None = None,
                   max_model_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq ``[rotary_dim // 2]``, attention_factor). ``scaling`` is the config's RoPE
    dict (``rope_parameters``, or None). ``max_position_embeddings`` (the config's) sets longrope's
    and yarn's default factor; ``max_model_len`` (the engine's) picks longrope's factor set."""
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    check_rope({**scaling, "rope_type": rope_type}, rotary_dim)
    if rope_type == "default":
        return _inv_freq(rotary_dim, theta), 1.0
    if rope_type == "llama3":
        return _llama3_scaling(_inv_freq(rotary_dim, theta), scaling), 1.0
    if rope_type == "linear":
        return _inv_freq(rotary_dim, theta) / scaling["factor"], 1.0
    if max_position_embeddings is None:
        raise ValueError(f"build_inv_freq: rope_type={rope_type!r} needs max_position_embeddings")
    if rope_type == "yarn":
        return _yarn(rotary_dim, theta, scaling, max_position_embeddings)
    if max_model_len is None:
        raise ValueError("build_inv_freq: rope_type='longrope' needs max_model_len (it picks the factor set)")
    return _longrope(rotary_dim, theta, scaling, max_position_embeddings, max_model_len)


def cos_sin_cache(inv_freq: torch.Tensor, attention_factor: float, max_position: int) -> torch.Tensor:
    """``[max_position, rotary_dim]`` float32: cos in the first half, sin in the second, both times
    ``attention_factor`` (as transformers scales them)."""
    t = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return cache * attention_factor if attention_factor != 1.0 else cache


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, rotary_dim: int, max_position: int, theta: float,
                 scaling: dict | None, is_neox: bool = True, max_position_embeddings: int | None = None):
        super().__init__()
        inv_freq, attention_factor = build_inv_freq(rotary_dim, theta, scaling, max_position_embeddings,
                                                    max_position)
        self.register_buffer("cos_sin_cache", cos_sin_cache(inv_freq, attention_factor, max_position),
                             persistent=False)
        self.is_neox = is_neox
        self.head_size = head_size

    def forward(self, positions, q, k):
        return current_ops().rotary_embedding(positions, q, k, self.cos_sin_cache, self.is_neox)
