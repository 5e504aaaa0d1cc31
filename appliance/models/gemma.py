"""The Gemma family as plain PyTorch: Gemma 2 (Gemma2ForCausalLM) and Gemma 3 text (Gemma3ForCausalLM, and
the text model of a Gemma3ForConditionalGeneration checkpoint, its vision tower left out).

What differs from Llama (held against transformers' modeling_gemma2.py / modeling_gemma3.py):
- RMSNorm scales by ``1 + w`` in float32 (``OffsetRMSNorm``); four norms per layer: input, post-attention,
  pre- and post-feed-forward, each residual added after the post norm;
- GeGLU: ``gelu_tanh(gate) * up`` (``hidden_activation``);
- embeddings times ``sqrt(hidden_size)``, the factor rounded to the weights' dtype as transformers does;
- softmax scale ``query_pre_attn_scalar ** -0.5``; attention-logit soft-capping (Gemma 2) and final-logit
  soft-capping (``compute_logits``): ``cap * tanh(x / cap)``;
- ``layer_types``: sliding-window (local) and full (global) layers, each type with its own RoPE table
  (Gemma 3: ``rope_local_base_freq`` / ``rope_parameters.sliding_attention`` for local layers, the global
  base and rope scaling for global ones);
- Gemma 3: per-head q/k RMSNorm before RoPE.

With native ops and every projection on a method the stack applies, the decoder layers run as one native
call (``ops.native.llama_layers`` with its Gemma extras: sandwich norms, GeGLU, a RoPE table per layer, the
attention soft-cap), the same kernels as the per-op path in its order; else op by op.

Tensor parallel shards as Llama does (``models/llama.py``): heads, the MLP width and the vocabulary.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from appliance.distributed.parallel_state import get_tp_group
from appliance.errors import ModelLoadError
from appliance.layers.attention import Attention, layer_sliding_windows
from appliance.layers.forward_context import current_ops
from appliance.layers.linear import Linear
from appliance.layers.norm import OffsetRMSNorm
from appliance.layers.rotary import build_inv_freq, check_rope, cos_sin_cache
from appliance.layers.vocab import VocabEmbedding, tied_lm_head
from appliance.models.config_checks import check_config
from appliance.models.llama import (cached_fused_plan, check_tp_sizes, fused_cache_ok, fused_linear_entries,
                                    fused_param_for)

log = logging.getLogger("appliance")

SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma's chat template closes every turn with <end_of_turn>; the model emits it, not <eos>, after a reply
TURN_END_TOKENS = ("<end_of_turn>",)
# hidden_activation -> torch's F.gelu ``approximate``
_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the architectures this file serves."""

    qk_norm: bool  # Gemma 3
    attn_softcap: bool  # Gemma 2 applies attn_logit_softcapping; transformers' Gemma 3 attention never does
    text_config: bool = False  # Gemma3ForConditionalGeneration: the text model lives under text_config
    final_softcap: bool = True  # Gemma3ForConditionalGeneration's head applies no final soft-cap
    defaults: tuple = ()  # (field, value) transformers' config class assumes when config.json leaves it out


_GEMMA2_DEFAULTS = (("sliding_window", 4096), ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0))
_GEMMA3_DEFAULTS = (("sliding_window", 4096),)
ARCHS = {
    "Gemma2ForCausalLM": ArchSpec(qk_norm=False, attn_softcap=True, defaults=_GEMMA2_DEFAULTS),
    "Gemma3ForCausalLM": ArchSpec(qk_norm=True, attn_softcap=False, defaults=_GEMMA3_DEFAULTS),
    "Gemma3ForConditionalGeneration": ArchSpec(qk_norm=True, attn_softcap=False, text_config=True,
                                               final_softcap=False, defaults=_GEMMA3_DEFAULTS),
}


@dataclass(frozen=True)
class GemmaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    gelu_approximate: str
    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    layer_types: tuple[str, ...]
    # per layer: its attention's sliding window, None for a global layer (read by the model runner too)
    sliding_windows: tuple[int | None, ...]
    rope: tuple[tuple[str, float, dict | None], ...]  # (layer type, theta, scaling) per type
    qk_norm: bool

    @classmethod
    def from_hf(cls, hf: dict, arch: ArchSpec) -> "GemmaConfig":
        where = "config.json"
        top = hf
        if arch.text_config:
            if not isinstance(hf.get("text_config"), dict):
                raise ModelLoadError(f"{where}: text_config must be an object (the Gemma 3 text model), "
                                     f"got {type(hf.get('text_config')).__name__}")
            if hf.get("vision_config") is not None:
                log.info("%s: Gemma 3 vision tower and projector are not loaded; serving the text model", where)
            hf, where = hf["text_config"], "config.json: text_config"
        hf = {**dict(arch.defaults), **hf}
        heads = hf["num_attention_heads"]
        n_layers = hf["num_hidden_layers"]
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _ACTIVATIONS:
            raise ModelLoadError(f"{where}: hidden_activation {act!r} is not supported; supported: "
                                 f"{', '.join(_ACTIVATIONS)}")
        if hf.get("use_bidirectional_attention"):
            raise ModelLoadError(f"{where}: use_bidirectional_attention={hf['use_bidirectional_attention']!r} is not "
                                 "supported (the engine runs causal attention only)")
        # what no family implements (attention sinks, another modality inside the text config, partial rotary)
        check_config(hf, rope={"partial_rotary_factor": hf.get("partial_rotary_factor", 1.0)},
                     rotary_dim=hf.get("head_dim") or hf["hidden_size"] // heads, activations=tuple(_ACTIVATIONS),
                     where=where)
        layer_types = tuple(hf.get("layer_types") or cls._default_layer_types(hf, n_layers, arch))
        if len(layer_types) != n_layers or not set(layer_types) <= {SLIDING, FULL}:
            raise ModelLoadError(f"{where}: layer_types must name {n_layers} layers, each {SLIDING!r} or {FULL!r}; "
                                 f"got {list(layer_types)!r}")
        # the one reader of window fields, given the layer types transformers' config class defaults to
        windows = layer_sliding_windows({**hf, "layer_types": list(layer_types)}, n_layers)
        attn_cap = hf.get("attn_logit_softcapping") if arch.attn_softcap else None
        final_cap = hf.get("final_logit_softcapping") if arch.final_softcap else None
        for name, cap in (("attn_logit_softcapping", attn_cap), ("final_logit_softcapping", final_cap)):
            if cap is not None and not cap > 0:
                raise ModelLoadError(f"{where}: {name} must be positive or null, got {cap!r}")
        tie = top.get("tie_word_embeddings", hf.get("tie_word_embeddings", True))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(tie),
            attention_bias=bool(hf.get("attention_bias", False)),
            gelu_approximate=_ACTIVATIONS[act],
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
            attn_logit_softcapping=None if attn_cap is None else float(attn_cap),
            final_logit_softcapping=None if final_cap is None else float(final_cap),
            layer_types=layer_types,
            sliding_windows=tuple(windows),
            rope=cls._rope(hf, set(layer_types), arch, where),
            qk_norm=arch.qk_norm,
        )

    @staticmethod
    def _default_layer_types(hf: dict, n_layers: int, arch: ArchSpec) -> list[str]:
        # transformers' defaults: Gemma 2 alternates (local first), Gemma 3 has one global layer in every
        # sliding_window_pattern (6)
        period = 2 if not arch.qk_norm else int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
        return [SLIDING if (i + 1) % period else FULL for i in range(n_layers)]

    @staticmethod
    def _rope(hf: dict, types: set[str], arch: ArchSpec, where: str):
        """(layer type, theta, scaling) for each layer type: transformers 5 writes ``rope_parameters`` per
        layer type ({"sliding_attention": {...}, "full_attention": {...}}) for Gemma 3, one dict for
        Gemma 2; older configs ``rope_theta``, ``rope_local_base_freq`` and ``rope_scaling`` (which applies
        to the global layers only)."""
        params = hf.get("rope_parameters") or {}
        out = []
        for t in sorted(types):
            if SLIDING in params or FULL in params:
                p = dict(params.get(t) or {})
            elif arch.qk_norm:  # Gemma 3, older config: one rope dict, the global layers'
                p = dict(params or hf.get("rope_scaling") or {}) if t == FULL else {}
                p.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0) if t == FULL
                             else hf.get("rope_local_base_freq", 10_000.0))
            else:
                p = dict(params or hf.get("rope_scaling") or {})
                p.setdefault("rope_theta", hf.get("rope_theta", 10_000.0))
            theta = p.pop("rope_theta", None)
            if not isinstance(theta, (int, float)) or theta <= 0:
                raise ModelLoadError(f"{where}: rope_parameters.{t}.rope_theta must be a positive number, got {theta!r}")
            kind = p.get("rope_type", p.get("type", "default"))
            scaling = p if kind not in (None, "default") else None
            # an unsupported rope type or parameters that do not fit the head are refused here, at config time
            check_rope(scaling or {}, int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]),
                       f"{where} ({t} layers)")
            out.append((t, float(theta), scaling))
        return tuple(out)


class SelfAttention(nn.Module):
    def __init__(self, cfg: GemmaConfig, layer_idx: int):
        super().__init__()
        d = cfg.head_dim
        # tensor parallel (as Llama): this rank's query and KV heads; the projections keep their rank's part
        tp = get_tp_group().world_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp, d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        q_full, kv_full = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        self.qkv_proj = Linear(cfg.hidden_size, q_full + 2 * kv_full, bias=cfg.attention_bias, shards={
            "q_proj": (0, q_full),
            "k_proj": (q_full, kv_full),
            "v_proj": (q_full + kv_full, kv_full),
        }, tp="column")
        self.o_proj = Linear(q_full, cfg.hidden_size, bias=cfg.attention_bias, tp="row")
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = OffsetRMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = OffsetRMSNorm(d, cfg.rms_norm_eps)
        self.layer_type = cfg.layer_types[layer_idx]
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, cfg.query_pre_attn_scalar ** -0.5, layer_idx,
                              sliding_window=cfg.sliding_windows[layer_idx],
                              logits_soft_cap=cfg.attn_logit_softcapping)

    def forward(self, cos_sin: dict, positions, x):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = current_ops().rotary_embedding(positions, q, k, cos_sin[self.layer_type], True)
        return self.o_proj(self.attn(q, k, v))


class MLP(nn.Module):
    """GeGLU: down(gelu(gate) * up). The [gate; up] projection is not marked ``silu_mul_next``: the native
    GEMM's fused epilogue is SiLU's."""

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * i, shards={"gate_proj": (0, i), "up_proj": (i, i)},
                                   tp="column")
        self.down_proj = Linear(i, cfg.hidden_size, tp="row")
        self.approximate = cfg.gelu_approximate

    def forward(self, x):
        return self.down_proj(current_ops().gelu_and_mul(self.gate_up_proj(x), self.approximate))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: GemmaConfig, layer_idx: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(h, eps)
        self.self_attn = SelfAttention(cfg, layer_idx)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps)

    def forward(self, cos_sin, positions, x, residual):
        """``x``: the previous layer's post-feed-forward-normed output, not yet added to ``residual``
        (None for the first layer, where ``x`` is the scaled embedding). Returns the same pair."""
        if residual is None:
            residual = x.clone()
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(cos_sin, positions, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Model(nn.Module):
    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp=True)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# Checkpoint prefixes of a Gemma3ForConditionalGeneration's text model (transformers 5 still writes the
# first form; the second is its in-memory name) and of the parts that are not loaded.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class GemmaForCausalLM(nn.Module):
    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.config = cfg
        self.tp_group = get_tp_group()
        check_tp_sizes(cfg, self.tp_group.world_size)
        self.model = Model(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, tp="vocab")
        self.cos_sin: dict[str, torch.Tensor] = {}
        self.embed_scale: torch.Tensor | None = None
        self.fused_calls = 0  # forwards run by the one-call native stack (_fused_layers)

    def prepare(self, max_position: int, device: torch.device) -> None:
        """After weights are loaded and cast: a RoPE table per layer type, the norms' float32 factors,
        the embedding scale."""
        cfg = self.config
        for layer_type, theta, scaling in cfg.rope:
            # the one rotary table builder (rotary.cos_sin_cache): a scaling's attention factor applies too
            inv_freq, factor = build_inv_freq(cfg.head_dim, theta, scaling, cfg.max_position_embeddings,
                                              max_position)
            self.cos_sin[layer_type] = cos_sin_cache(inv_freq, factor, max_position).to(device)
        for m in self.modules():
            if isinstance(m, OffsetRMSNorm):
                m.finalize()
        emb = self.model.embed_tokens  # float (VocabEmbedding) or, from a GGUF's kept type, a QuantEmbedding
        dtype, dev = (emb.weight.dtype, emb.weight.device) if isinstance(emb, nn.Embedding) else (emb.dtype, device)
        # transformers: a float32 buffer sqrt(hidden) cast to the weights' dtype at each call
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32).to(dtype).to(dev)
        if cfg.tie_word_embeddings:
            # as in LlamaForCausalLM: the logits projection on the embedding's table, float or quantized
            self.lm_head = tied_lm_head(emb)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden]."""
        x = self.model.embed_tokens(input_ids) * self.embed_scale
        fused = self._fused_layers()
        if fused is not None:
            return fused(x, positions)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(self.cos_sin, positions, x, residual)
        x, _ = self.model.norm(x, residual)
        return x

    def _fused_layers(self):
        """The decoder stack as one native call (``ops.native.llama_layers`` with Gemma's extras), or None,
        under the Llama stack's conditions (``LlamaForCausalLM._fused_layers``): native ops with
        FUSED_LAYERS, every projection on a method the stack applies, activations of one dtype the
        kernels take, KV caches they read (``fused_cache_ok``, quantized ones included), float32 RoPE tables
        on the CPU, head_dim a multiple of 16."""
        found = cached_fused_plan(self)
        if found is None:
            return None
        (flat, kinds, extras), ctx, all_reduce, kv_scales = found
        ops = ctx.ops
        cfg, md = self.config, ctx.attn
        at = self.model.layers[0].self_attn  # this rank's heads and MLP width
        intermediate = self.model.layers[0].mlp.down_proj.in_features
        windows = [layer.self_attn.attn.sliding_window for layer in self.model.layers]
        act = ops.ACT_GELU_TANH if cfg.gelu_approximate == "tanh" else ops.ACT_GELU
        shared = self.cos_sin[cfg.layer_types[0]]

        def run(x, positions):
            self.fused_calls += 1  # which path ran, for tests and benchmarks (equal outputs cannot tell)
            return ops.llama_layers(
                x, positions, flat, kinds, windows, self.model.norm.scale, cfg.rms_norm_eps, at.num_heads,
                at.num_kv_heads, cfg.head_dim, intermediate, at.attn.scale, shared, md.slot_mapping,
                md.block_table, md.seq_lens, md.query_start_loc, all_reduce, extras=extras, act=act,
                logits_soft_cap=at.attn.logits_soft_cap, kv_scales=kv_scales)
        return run

    def _linears(self, i: int):
        layer = self.model.layers[i]
        return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)

    def _build_fused_plan(self, kv_caches):
        cfg = self.config
        if cfg.head_dim % 16 or cfg.num_attention_heads % cfg.num_key_value_heads or not self.cos_sin:
            return None
        if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in self.cos_sin.values()):
            return None
        dt = self.model.norm.weight.dtype  # the model's dtype (the parameters are cast to it)
        if dt not in (torch.float32, torch.bfloat16) or len(kv_caches) != len(self.model.layers):
            return None
        shared = self.cos_sin[cfg.layer_types[0]]
        empty = torch.empty(0)
        flat: list[torch.Tensor] = []
        kinds: list[int] = []
        extras: list[torch.Tensor] = []
        for i, (layer, (kc, vc)) in enumerate(zip(self.model.layers, kv_caches)):
            at = layer.self_attn
            descs = [m.fused_descriptor() for m in self._linears(i)]
            if any(d is None for d in descs) or at.o_proj.bias is not None:
                return None
            if not fused_cache_ok(kc, vc, dt):
                return None
            # the norms multiply by OffsetRMSNorm's float32 factor (1 + w), as on the per-op path
            flat += [layer.input_layernorm.scale, at.q_norm.scale if at.qk_norm else empty,
                     at.k_norm.scale if at.qk_norm else empty, layer.post_attention_layernorm.scale, kc, vc]
            fused_linear_entries(descs, flat, kinds, empty)
            table = self.cos_sin[at.layer_type]
            extras += [layer.pre_feedforward_layernorm.scale, layer.post_feedforward_layernorm.scale,
                       empty if table is shared else table]
        return flat, kinds, extras

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> float32 logits [n, vocab], soft-capped when the config says so."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in the model dtype, as transformers does, before the float32 cast
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def ignored_weight(self, name: str) -> bool:
        """Checkpoint tensors this model does not load: a Gemma 3 checkpoint's vision tower and projector, and
        a copy of the tied lm_head under the text model's prefix."""
        if self.config.tie_word_embeddings and name == "language_model.lm_head.weight":
            return True
        return name.startswith(_VISION_PREFIXES)

    def param_for(self, name: str) -> tuple[str, str | None]:
        """Map a checkpoint tensor name to (parameter name, shard of a fused weight or None)."""
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        return fused_param_for(name)


# tensor-parallel support: heads, MLP and vocabulary shard as Llama's (appliance.distributed)
supports_tensor_parallel = True
FAMILY_CONFIG = GemmaConfig  # registry.family_config: the parsed config check_tp_sizes reads


def build(architecture: str, hf_config: dict) -> GemmaForCausalLM:
    return GemmaForCausalLM(GemmaConfig.from_hf(hf_config, ARCHS[architecture]))
