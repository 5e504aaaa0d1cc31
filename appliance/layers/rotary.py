"""Rotary position embedding: inverse frequencies (default and Llama-3.1 ``llama3`` scaling) and a
cos/sin cache built once at load."""
from __future__ import annotations

import math

import torch
from torch import nn

from appliance.errors import ModelLoadError


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


def build_inv_freq(rotary_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq, attention_factor). ``scaling`` is the config's rope_scaling /
    rope_parameters dict (or None)."""
    inv = _inv_freq(rotary_dim, theta)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) or "default"
    if rope_type == "default":
        return inv, 1.0
    if rope_type == "llama3":
        return _llama3_scaling(inv, scaling), 1.0
    if rope_type == "linear":
        return inv / scaling["factor"], 1.0
    raise ModelLoadError(f"config.json: unsupported rope scaling type {rope_type!r}; supported: default, llama3, linear")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, rotary_dim: int, max_position: int, theta: float,
                 scaling: dict | None, is_neox: bool = True):
        super().__init__()
        inv_freq, _ = build_inv_freq(rotary_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
        self.is_neox = is_neox
        self.head_size = head_size

    def forward(self, ops, positions, q, k):
        return ops.rotary_embedding(positions, q, k, self.cos_sin_cache, self.is_neox)
