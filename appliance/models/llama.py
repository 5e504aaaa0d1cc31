"""The Llama family as plain PyTorch: Llama 2/3.x (and SmolLM2), Mistral, Qwen2 (q/k/v bias),
Qwen3 (per-head q/k RMSNorm) and Phi-3/3.5/4-mini (checkpoints hold q/k/v and gate/up fused, which
load whole into the fused projections; longrope; partial rotary). One module, switched by a few
architecture facts.

Tokens are packed: ``input_ids`` and ``positions`` are ``[num_tokens]`` for the whole step; the
attention layer reads the batch layout from the forward context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from appliance.distributed.parallel_state import get_tp_group
from appliance.errors import ModelLoadError
from appliance.layers.attention import Attention, layer_sliding_windows
from appliance.layers.forward_context import current_ops, get_forward_context
from appliance.layers.linear import Linear
from appliance.layers.methods import floating
from appliance.layers.norm import RMSNorm
from appliance.layers.rotary import build_inv_freq, cos_sin_cache, rope_parameters, rotary_dim
from appliance.layers.vocab import VocabEmbedding, tied_lm_head
from appliance.models.config_checks import check_config
from appliance.ops.reference import kv_cache_is_quantized


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the architectures this file serves."""

    qkv_bias: bool = False
    qk_norm: bool = False
    partial_rotary: bool = False  # rotates the first partial_rotary_factor of each head (transformers does)
    rope_aliases: tuple[tuple[str, str], ...] = ()  # old rope_type names the config class renames
    # reads the config's sliding-window fields (transformers' Llama has none and ignores them)
    sliding_window: bool = True
    # a bare ``*Model`` (embedding checkpoints; ``--runner pooling``): no lm_head, final hidden states only
    pooling: bool = False


ARCHS = {
    "LlamaForCausalLM": ArchSpec(sliding_window=False),
    "MistralForCausalLM": ArchSpec(),
    "Qwen2ForCausalLM": ArchSpec(qkv_bias=True),
    "Qwen3ForCausalLM": ArchSpec(qk_norm=True),
    # Phi3Config renames "su" and "yarn" to "longrope"; Phi-3 never has q/k/v or MLP biases.
    "Phi3ForCausalLM": ArchSpec(partial_rotary=True, rope_aliases=(("su", "longrope"), ("yarn", "longrope"))),
    # the same stacks without lm_head, for pooling (registry.pooling_architecture maps X*ForCausalLM here)
    "LlamaModel": ArchSpec(sliding_window=False, pooling=True),
    "MistralModel": ArchSpec(pooling=True),
    "Qwen2Model": ArchSpec(qkv_bias=True, pooling=True),
    "Qwen3Model": ArchSpec(qk_norm=True, pooling=True),
}


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    mlp_bias: bool = False
    rotary_dim: int = 0  # 0: head_dim
    # per layer: its attention's sliding window, None for full attention (layer_sliding_windows)
    sliding_windows: tuple[int | None, ...] = ()
    has_lm_head: bool = True  # False: a pooling model (ArchSpec.pooling)

    @classmethod
    def from_hf(cls, hf: dict, arch: ArchSpec) -> "LlamaConfig":
        heads = hf["num_attention_heads"]
        rope = rope_parameters(hf, dict(arch.rope_aliases))
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        rot = rotary_dim(head_dim, rope)
        check_config(hf, rope=rope, rotary_dim=rot, activations=("silu", "swish"), partial_rotary=arch.partial_rotary)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope["rope_theta"]),
            rope_scaling=rope,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch.qkv_bias or bool(hf.get("attention_bias", False)),
            qk_norm=arch.qk_norm,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            rotary_dim=rot,
            sliding_windows=tuple(layer_sliding_windows(hf, hf["num_hidden_layers"]) if arch.sliding_window
                                  else [None] * hf["num_hidden_layers"]),
            has_lm_head=not arch.pooling,
        )


class Rotary:
    """cos/sin cache as a plain tensor (not a buffer) so meta-device construction leaves it intact."""

    def __init__(self, cfg: LlamaConfig, max_position: int, device: torch.device):
        # max_position is the engine's max_model_len: it also fixes longrope's factor set
        inv_freq, attention_factor = build_inv_freq(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                                    cfg.max_position_embeddings, max_position)
        self.cos_sin_cache = cos_sin_cache(inv_freq, attention_factor, max_position).to(device)


class SelfAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__()
        d = cfg.head_dim
        # tensor parallel: each rank holds num_heads / tp query heads and num_kv_heads / tp KV heads
        # (the projections are built with the full sizes and keep their rank's part)
        tp = get_tp_group().world_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp, d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        q_full, kv_full = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        self.qkv_proj = Linear(cfg.hidden_size, q_full + 2 * kv_full, bias=cfg.qkv_bias, shards={
            "q_proj": (0, q_full),
            "k_proj": (q_full, kv_full),
            "v_proj": (q_full + kv_full, kv_full),
        }, tp="column")
        self.o_proj = Linear(q_full, cfg.hidden_size, tp="row")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        window = cfg.sliding_windows[layer_idx] if cfg.sliding_windows else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, d ** -0.5, layer_idx, sliding_window=window)

    def forward(self, rotary: Rotary, positions, x):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = current_ops().rotary_embedding(positions, q, k, rotary.cos_sin_cache, True)
        return self.o_proj(self.attn(q, k, v))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, down_tp: str = "row"):
        """``down_tp="row_partial"``: under tensor parallelism the output is this rank's partial sum,
        all-reduced by the caller (an MoE block, once for all its experts)."""
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * i, bias=cfg.mlp_bias,
                                   shards={"gate_proj": (0, i), "up_proj": (i, i)}, tp="column")
        self.gate_up_proj.silu_mul_next = True
        self.down_proj = Linear(i, cfg.hidden_size, bias=cfg.mlp_bias, tp=down_tp)

    def forward(self, x):
        gu = self.gate_up_proj
        if getattr(gu, "fused_silu_mul", False):  # native float GEMM: silu(gate) * up in its epilogue
            return self.down_proj(gu.forward_silu_mul(x))
        return self.down_proj(current_ops().silu_and_mul(gu(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, rotary, positions, x, residual):
        if residual is None:
            residual = x.clone()
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rotary, positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Model(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp=True)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _or_empty(t: torch.Tensor | None, empty: torch.Tensor) -> torch.Tensor:
    return empty if t is None else t


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tp_group = get_tp_group()
        check_tp_sizes(cfg, self.tp_group.world_size)
        self.model = Model(cfg)
        if not cfg.tie_word_embeddings and cfg.has_lm_head:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, tp="vocab")
        self.rotary: Rotary | None = None
        self.fused_calls = 0  # forwards run by the one-call native stack (_fused_layers)

    def prepare(self, max_position: int, device: torch.device) -> None:
        """After weights are loaded: build the rotary cache (and tie the logits projection)."""
        self.rotary = Rotary(self.config, max_position, device)
        if self.config.tie_word_embeddings and self.config.has_lm_head:
            # The logits projection shares the embedding's table (float or quantized); as a linear
            # layer, the linear methods apply to it like to any other.
            self.lm_head = tied_lm_head(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden]."""
        x = self.model.embed_tokens(input_ids)
        fused = self._fused_layers()
        if fused is not None:
            return fused(x, positions)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(self.rotary, positions, x, residual)
        x, _ = self.model.norm(x, residual)
        return x

    def _fused_layers(self):
        """The whole decoder stack as one native call (``ops.native.llama_layers``), or None. Only when
        the per-op path would run every op natively anyway: native ops with FUSED_LAYERS, every q/k/v,
        o, gate/up and down projection on a method the stack applies (``fused_descriptor``), norms and
        activations of one dtype the kernels take (float32 or bfloat16), KV caches the attention kernels
        read (``fused_cache_ok``: the model's dtype, bfloat16, or int8/fp8 with their scales), a float32
        rotary table, head_dim a multiple of 16."""
        found = cached_fused_plan(self)
        if found is None:
            return None
        (flat, kinds), ctx, all_reduce, kv_scales = found
        ops = ctx.ops
        cfg, md = self.config, ctx.attn
        at = self.model.layers[0].self_attn  # this rank's heads and MLP width (all of them on one rank)
        scale = at.attn.scale
        intermediate = self.model.layers[0].mlp.down_proj.in_features
        windows = [layer.self_attn.attn.sliding_window for layer in self.model.layers]

        def run(x, positions):
            self.fused_calls += 1  # which path ran, for tests and benchmarks (equal outputs cannot tell)
            return ops.llama_layers(
                x, positions, flat, kinds, windows, self.model.norm.weight, cfg.rms_norm_eps, at.num_heads,
                at.num_kv_heads, cfg.head_dim, intermediate, scale, self.rotary.cos_sin_cache,
                md.slot_mapping, md.block_table, md.seq_lens, md.query_start_loc, all_reduce, kv_scales=kv_scales)
        return run

    def _linears(self, i: int):
        layer = self.model.layers[i]
        return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)

    def _build_fused_plan(self, kv_caches):
        cfg = self.config
        if cfg.head_dim % 16 or cfg.num_attention_heads % cfg.num_key_value_heads or self.rotary is None:
            return None
        if self.rotary.cos_sin_cache.dtype != torch.float32 or self.rotary.cos_sin_cache.device.type != "cpu":
            return None
        dt = self.model.norm.weight.dtype
        if dt not in (torch.float32, torch.bfloat16) or len(kv_caches) != len(self.model.layers):
            return None
        empty = torch.empty(0)
        flat: list[torch.Tensor] = []
        kinds: list[int] = []
        for i, (layer, (kc, vc)) in enumerate(zip(self.model.layers, kv_caches)):
            at, mlp = layer.self_attn, layer.mlp
            descs = [m.fused_descriptor() for m in self._linears(i)]
            if any(d is None for d in descs) or at.o_proj.bias is not None:
                return None
            qkv, o, gu, down = descs
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if at.qk_norm:
                norms += [at.q_norm.weight, at.k_norm.weight]
            if any(w.dtype != dt for w in norms) or not fused_cache_ok(kc, vc, dt):
                return None
            # the layout of llama_layers (native/neon_sve/bindings/torch_bindings.cpp): the layer's
            # own tensors, then per projection weight, bias and 3 aux tensors, and 4 ints
            flat += [layer.input_layernorm.weight, at.q_norm.weight if at.qk_norm else empty,
                     at.k_norm.weight if at.qk_norm else empty, layer.post_attention_layernorm.weight, kc, vc]
            fused_linear_entries(descs, flat, kinds, empty)
        return flat, kinds

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> float32 logits [n, vocab]."""
        return self.lm_head(hidden).float()

    def param_for(self, name: str) -> tuple[str, str | None]:
        if not self.config.has_lm_head and not name.startswith(("model.", "lm_head.")):
            name = "model." + name  # a saved bare *Model (embedding checkpoints) has no "model." prefix
        return fused_param_for(name)


def fused_linear_entries(descs, flat: list, kinds: list, empty: torch.Tensor) -> None:
    """Append a layer's q/k/v, o, gate/up and down projections in ``llama_layers``' layout: per projection
    its weight, bias and 3 aux tensors (an empty tensor where it has none) to ``flat``, its kind and 3 ints
    to ``kinds`` (from the linear methods' ``fused_descriptor``)."""
    for d in descs:
        aux = tuple(d.aux) + (None,) * (3 - len(d.aux))
        flat += [d.weight, _or_empty(d.bias, empty), *(_or_empty(a, empty) for a in aux)]
        kinds += [d.kind, *(tuple(d.ints) + (0,) * (3 - len(d.ints)))]



def fused_cache_ok(kc: torch.Tensor, vc: torch.Tensor, dt: torch.dtype) -> bool:
    """Whether the one-call stack takes a layer's KV caches under a model of dtype ``dt``: contiguous, of one
    dtype, and one the native attention kernels read and write (as the per-op path's ``reshape_and_cache``
    and ``paged_attention`` do): the model's own, bfloat16 (``--kv-cache-dtype bfloat16`` under a float32
    model), or a quantized one (int8 / fp8; its scales are checked by ``cached_fused_plan``)."""
    return (kc.dtype == vc.dtype and kc.is_contiguous() and vc.is_contiguous()
            and (kc.dtype in (dt, torch.bfloat16) or kv_cache_is_quantized(kc.dtype)))


def _fused_kv_scales(ops, kv_caches, kv_scales) -> list[torch.Tensor] | None:
    """The stack's ``kv_scales``: empty for float caches, per layer (k_scale, v_scale) for quantized ones,
    or None where a quantized cache lacks scales the kernels take (then the per-op path runs, and its
    ops fall back to the reference as they would)."""
    if not any(kv_cache_is_quantized(kc.dtype) for kc, _ in kv_caches):
        return []
    if kv_scales is None or len(kv_scales) != len(kv_caches):
        return None
    flat: list[torch.Tensor] = []
    for (kc, vc), (ks, vs) in zip(kv_caches, kv_scales):
        if not (ops.kv_scales_ok(kc, ks) and ops.kv_scales_ok(vc, vs)):
            return None
        flat += [ks, vs]
    return flat


def cached_fused_plan(model: nn.Module):
    """``(plan, forward context, all-reduce entry, kv_scales)`` for a model's one-call decoder stack, or
    None where the stack cannot run this step: native ops with FUSED_LAYERS only, and under tensor
    parallel only with a communicator that has a native entry (shared memory; gloo leaves the per-op
    path). The plan (``model._build_fused_plan(kv_caches)``, None where the stack does not apply) is kept
    on the model and rebuilt for a new KV cache or a layer packed anew (set_backend); ``kv_scales`` are a
    quantized cache's per-layer k/v scales in ``llama_layers``' layout (empty for a float cache)."""
    ctx = get_forward_context()
    ops = ctx.ops
    if not getattr(ops, "FUSED_LAYERS", False) or not hasattr(ops, "llama_layers"):
        return None
    # tensor parallel: the stack sums the row-parallel o_proj and down_proj outputs itself
    all_reduce = model.tp_group.communicator.native_all_reduce() if model.tp_group.is_parallel else (0, 0)
    if all_reduce is None:
        return None
    key = (id(ctx.kv_caches), id(ctx.kv_scales)) + tuple(id(d.weight) if (d := m.fused_descriptor()) else None
                                                        for m in model._linears(0))
    plan = model.__dict__.get("_fused_plan")
    if plan is None or plan[0] != key:
        scales = _fused_kv_scales(ops, ctx.kv_caches, ctx.kv_scales)
        built = None if scales is None else model._build_fused_plan(ctx.kv_caches)
        # a native float layer that leaves prefill-sized steps to torch's batched GEMM (not one packed
        # for every size by --batch-invariant)
        native_f32 = built is not None and any(m.backend == "native" and not m.method.every_size(m.packed)
                                               for i in range(len(model.model.layers)) for m in model._linears(i))
        plan = (key, built, scales, native_f32)
        model.__dict__["_fused_plan"] = plan
    if plan[1] is None:
        return None
    if plan[3] and ctx.attn.slot_mapping.shape[0] > floating.NATIVE_F32_MAX_ROWS:
        # the stack applies a native layer with the panel kernel at any number of rows; the per-op
        # path gives a prefill-sized step torch's batched GEMM over the same panels (NativeLinear)
        return None
    return plan[1], ctx, all_reduce, plan[2]

# tensor-parallel support: the architectures of this file shard (appliance.distributed)
supports_tensor_parallel = True


def check_tp_sizes(cfg: LlamaConfig, tp: int, more: dict[str, int] | None = None) -> None:
    """Refuse a tensor-parallel size that does not split the heads, the MLP or the vocabulary evenly
    (nor any of ``more``: a family's other split sizes, e.g. an MoE expert's width)."""
    if tp == 1:
        return
    sizes = {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
             "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size, **(more or {})}
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        import math

        g = math.gcd(*sizes.values())
        valid = [n for n in range(1, g + 1) if g % n == 0]
        raise ModelLoadError(f"tensor_parallel_size={tp} does not divide the model's "
                             + ", ".join(f"{k}={v}" for k, v in bad.items())
                             + f"; valid sizes for this model: {', '.join(map(str, valid))}")


def fused_param_for(name: str) -> tuple[str, str | None]:
    """Map a checkpoint tensor name to (parameter name, shard of a fused weight or None): q/k/v into
    ``qkv_proj``, gate/up into ``gate_up_proj`` (the fused Linear layers of every family here)."""
    for shard in ("q_proj", "k_proj", "v_proj"):
        if f".self_attn.{shard}." in name:
            return name.replace(f".{shard}.", ".qkv_proj."), shard
    for shard in ("gate_proj", "up_proj"):
        if f".mlp.{shard}." in name:
            return name.replace(f".{shard}.", ".gate_up_proj."), shard
    return name, None


def build(architecture: str, hf_config: dict) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig.from_hf(hf_config, ARCHS[architecture]))
