"""Paged attention layer: writes this step's K/V into the cache, then attends over the paged context.
The cache layout and the kernels belong to the ops backend (reference or native).

``layer_sliding_windows`` is the one reader of a config's sliding-window fields: every model file
asks it for its layers' windows."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from appliance.errors import ModelLoadError
from appliance.layers.forward_context import get_forward_context

_LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' Mistral and Mixtral apply ``sliding_window`` to every layer and ignore ``layer_types``
_WINDOW_ON_EVERY_LAYER = ("mistral", "mixtral", "qwen3_moe")


def layer_sliding_windows(hf_config: dict, num_layers: int) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers 5 reads the config:

    - ``use_sliding_window: false`` (the Qwen2/Qwen3 families) turns every window off, whatever
      ``sliding_window`` and ``layer_types`` say (their configs set ``sliding_window`` to None then);
    - ``layer_types`` ("sliding_attention" / "full_attention" per layer), when present, picks the
      windowed layers (Gemma 2/3, and configs saved by transformers 5);
    - else, with ``use_sliding_window: true`` and ``max_window_layers``, layers ``i >= max_window_layers``
      are windowed (Qwen2Config's and Qwen3Config's rule), or for Qwen2-MoE the even layers
      ``i < max_window_layers`` (Qwen2MoeConfig's rule);
    - else ``sliding_window``, when set, applies to every layer (Mistral, Mixtral; Qwen3-MoE, whose
      attention takes the config's window on every layer and has no ``layer_types``).

    Raises ModelLoadError for a ``layer_types`` of the wrong length or with another kind of layer,
    and for a window that is not a positive integer."""
    window = hf_config.get("sliding_window")
    if "use_sliding_window" in hf_config and not hf_config["use_sliding_window"]:
        window = None
    if window is None:
        return [None] * num_layers
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"config.json: sliding_window must be a positive integer or null, got {window!r}")
    types = hf_config.get("layer_types")
    if types is not None and hf_config.get("model_type") not in _WINDOW_ON_EVERY_LAYER:
        if len(types) != num_layers:
            raise ModelLoadError(f"config.json: layer_types has {len(types)} entries; the model has "
                                 f"num_hidden_layers={num_layers}")
        bad = sorted({t for t in types if t not in _LAYER_TYPES})
        if bad:
            raise ModelLoadError(f"config.json: layer_types {bad!r} not supported; supported: "
                                 f"{', '.join(_LAYER_TYPES)}")
        return [window if t == "sliding_attention" else None for t in types]
    if (hf_config.get("use_sliding_window") and "max_window_layers" in hf_config
            and hf_config.get("model_type") not in _WINDOW_ON_EVERY_LAYER):
        m = int(hf_config["max_window_layers"])
        if hf_config.get("model_type") == "qwen2_moe":
            return [window if i % 2 == 0 and i < m else None for i in range(num_layers)]
        return [window if i >= m else None for i in range(num_layers)]
    return [window] * num_layers


class Attention(nn.Module):
    """``sliding_window``: attend only the last ``sliding_window`` positions (the query's own
    included); ``logits_soft_cap``: scores become ``c * tanh(scores / c)`` before the softmax.
    None (or 0) turns either off. See ``appliance.ops.reference.paged_attention``."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float, layer_idx: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = scale
        self.layer_idx = layer_idx
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if logits_soft_cap is not None and logits_soft_cap < 0:
            raise ValueError(f"logits_soft_cap must be >= 0 or None, got {logits_soft_cap}")
        self.sliding_window = int(sliding_window or 0)  # the kernels' convention: 0 is off
        self.logits_soft_cap = float(logits_soft_cap or 0.0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, num_heads, D]; k, v: [T, num_kv_heads, D] -> [T, num_heads * D]"""
        ctx = get_forward_context()
        md = ctx.attn
        key_cache, value_cache = ctx.kv_caches[self.layer_idx]
        # a quantized cache's per-row scales (--kv-cache-dtype int8/fp8); ops without them never see the kwargs
        kw = {}
        if ctx.kv_scales is not None:
            kw = dict(zip(("k_scale", "v_scale"), ctx.kv_scales[self.layer_idx]))
        ctx.ops.reshape_and_cache(k, v, key_cache, value_cache, md.slot_mapping, **kw)
        # SDPA's causal mask knows neither a window nor a soft cap: such layers go through the cache;
        # so does a cache of another dtype than k (bf16 or quantized KV): attention must read what it stores
        plain = not self.sliding_window and not self.logits_soft_cap and key_cache.dtype == k.dtype
        if md.is_prefill_only and plain and not getattr(ctx.ops, "PAGED_PREFILL", False):
            out = self._prefill_from_scratch(q, k, v, md.query_start_loc.tolist())
        else:
            out = ctx.ops.paged_attention(q, key_cache, value_cache, md.block_table, md.seq_lens,
                                          md.query_start_loc, self.scale, md.max_query_len,
                                          sliding_window=self.sliding_window,
                                          logits_soft_cap=self.logits_soft_cap, **kw)
        return out.reshape(q.shape[0], self.num_heads * self.head_size)

    def _prefill_from_scratch(self, q, k, v, qsl: list[int]) -> torch.Tensor:
        # No cached context: each sequence attends causally to its own fresh K/V only, so the
        # cache need not be read back; SDPA's fused CPU kernel does it in one call per sequence.
        # (Ops with PAGED_PREFILL, the native kernels, are faster over the cache even so: 16 x 128
        # tokens of the default model's shape take 2.3 ms there vs 6.7 ms in SDPA.)
        out = torch.empty_like(q)
        for s, e in zip(qsl[:-1], qsl[1:]):
            qs = q[s:e].transpose(0, 1)
            ks, vs = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale,
                                               enable_gqa=self.num_heads != self.num_kv_heads)
            out[s:e] = o.transpose(0, 1)
        return out
