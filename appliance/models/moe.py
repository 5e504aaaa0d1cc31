"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (with its sigmoid-gated shared expert) and
Qwen3-MoE (q/k norms as Qwen3). Attention, norms and the decoder layer are llama.py's; only the
feed-forward of the sparse layers differs: a router picking ``top_k`` of ``num_experts`` gated MLPs
per token (``appliance.layers.fused_moe``).

Checkpoint layouts read (both, whichever the file holds):
- per expert, as hub checkpoints and transformers' ``save_pretrained`` write them:
  ``mlp.experts.N.{gate,up,down}_proj.weight`` (Qwen) or ``block_sparse_moe.experts.N.w{1,3,2}.weight``
  (Mixtral: w1 gate, w3 up, w2 down), router ``mlp.gate.weight`` / ``block_sparse_moe.gate.weight``;
- fused 3-D, as transformers holds experts in memory: ``mlp.experts.gate_up_proj`` ``[E, 2 * I, H]``
  ([gate; up] rows per expert) and ``mlp.experts.down_proj`` ``[E, H, I]``, split per expert at load
  (``split_checkpoint_tensor``).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
from torch import nn

from appliance.distributed.parallel_state import get_tp_group
from appliance.errors import ModelLoadError
from appliance.layers.forward_context import current_ops
from appliance.layers.fused_moe import Router, grouped_experts, native_plan, row_invariant_linear
from appliance.layers.linear import share_of_probe_rows
from appliance.models import llama
from appliance.models.llama import LlamaConfig, LlamaForCausalLM, MLP


@dataclass(frozen=True)
class MoeSpec:
    """What differs between the MoE architectures this file serves."""

    qk_norm: bool = False
    shared_expert: bool = False
    # Mixtral always renormalizes the top-k weights and keeps them float32; Qwen reads
    # norm_topk_prob and casts them to the logits' dtype (transformers 5.24's routers).
    always_renormalize: bool = False
    weights_in_logits_dtype: bool = True
    # the config keys the expert count may be saved under (transformers maps one onto the other)
    num_experts_keys: tuple[str, ...] = ("num_experts", "num_local_experts")
    expert_size_key: str = "moe_intermediate_size"


ARCHS = {
    "MixtralForCausalLM": MoeSpec(always_renormalize=True, weights_in_logits_dtype=False,
                                  num_experts_keys=("num_local_experts",), expert_size_key="intermediate_size"),
    "Qwen2MoeForCausalLM": MoeSpec(shared_expert=True),
    "Qwen3MoeForCausalLM": MoeSpec(qk_norm=True),
}


@dataclass(frozen=True)
class MoeConfig(LlamaConfig):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    weights_in_logits_dtype: bool = True
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    sparse_layers: tuple[bool, ...] = ()  # per layer: MoE (True) or a dense MLP of intermediate_size

    @classmethod
    def from_hf(cls, hf: dict, spec: MoeSpec, architecture: str = "") -> "MoeConfig":
        where = f"config.json ({architecture})"
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{where}: hidden_act={act!r} is not supported (supported: 'silu')")
        if spec.qk_norm and hf.get("attention_bias"):  # Qwen3-MoE's o_proj would take a bias too
            raise ModelLoadError(f"{where}: attention_bias=True is not supported (supported: false)")
        base = LlamaConfig.from_hf(hf, llama.ArchSpec(qk_norm=spec.qk_norm))
        if architecture == "Qwen2MoeForCausalLM":
            base = dataclasses.replace(base, qkv_bias=bool(hf.get("qkv_bias", True)))
        key = next((k for k in spec.num_experts_keys if hf.get(k) is not None), spec.num_experts_keys[0])
        n_exp = int(hf.get(key) or 0)
        top_k = int(hf.get("num_experts_per_tok") or 0)
        if n_exp < 1:
            raise ModelLoadError(f"{where}: {key}={n_exp}; must be >= 1")
        if not 1 <= top_k <= n_exp:
            raise ModelLoadError(f"{where}: num_experts_per_tok={top_k}; must be in [1, "
                                 f"{key}={n_exp}]")
        expert_size = int(hf.get(spec.expert_size_key) or 0)
        if expert_size < 1:
            raise ModelLoadError(f"{where}: {spec.expert_size_key}={hf.get(spec.expert_size_key)!r}; must be >= 1")
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        mlp_only = set(hf.get("mlp_only_layers") or [])
        sparse = tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(base.num_hidden_layers))
        shared = int(hf.get("shared_expert_intermediate_size") or 0) if spec.shared_expert else 0
        if spec.shared_expert and shared < 1:
            raise ModelLoadError(f"{where}: shared_expert_intermediate_size={shared}; must be >= 1")
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaConfig)},
                   num_experts=n_exp, num_experts_per_tok=top_k,
                   moe_intermediate_size=expert_size,
                   norm_topk_prob=spec.always_renormalize or bool(hf.get("norm_topk_prob", False)),
                   weights_in_logits_dtype=spec.weights_in_logits_dtype,
                   shared_expert_intermediate_size=shared, sparse_layers=sparse)


class ExpertMLP(MLP):
    """A gated MLP of width ``intermediate`` (an expert, or Qwen2-MoE's shared expert): llama's MLP,
    so its [gate; up] and down projections are ``Linear`` layers like any other. Under tensor
    parallelism each rank holds a slice of the width (gate_up column-, down row-parallel) and returns
    its partial sum: the block all-reduces once (``row_partial``)."""

    def __init__(self, cfg: LlamaConfig, intermediate: int):
        super().__init__(dataclasses.replace(cfg, intermediate_size=intermediate), down_tp="row_partial")


# --batch-invariant's shared expert gate: columns computed (all equal), so that the sigmoid over them
# takes whole vectors on every ISA (two of torch's widest float vectors)
SHARED_GATE_WIDTH = 32


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's shared expert, scaled by ``sigmoid(shared_expert_gate(x))``).

    Tensor parallel: the router and the shared expert's gate are replicated (every rank routes its
    whole input alike), each expert's width is split (``ExpertMLP``), and the weighted sum of the
    rank's partial expert outputs is all-reduced once: sum over ranks of sum over experts equals the
    unsharded block, since routing weights and the sigmoid gate scale whole rows."""

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.tp_group = get_tp_group()
        self.gate = Router(cfg.num_experts, cfg.hidden_size, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                           cfg.weights_in_logits_dtype)
        self.experts = nn.ModuleList(ExpertMLP(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = ExpertMLP(cfg, cfg.shared_expert_intermediate_size)
            # a [1, hidden] float gate (like the router, never quantized)
            self.shared_expert_gate = nn.Module()
            self.shared_expert_gate.weight = nn.Parameter(torch.empty(1, cfg.hidden_size), requires_grad=False)
        self.shared_gate_linear = None  # --batch-invariant (make_row_invariant)
        self.native_calls = 0  # forwards run by ops.moe_experts (which path ran, for tests and benchmarks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, weights, ids = self.gate(x)
        run = self._native_experts()
        out = run(x, ids, weights) if run is not None else grouped_experts(x, ids, weights, self.experts)
        if self.shared_expert is not None:
            if self.shared_gate_linear is None:
                g = torch.sigmoid(torch.nn.functional.linear(x, self.shared_expert_gate.weight))
            else:
                g = torch.sigmoid(self.shared_gate_linear(x))[:, :1]
            out = out + g * self.shared_expert(x)
        if self.tp_group.is_parallel:
            out = self.tp_group.communicator.all_reduce_(out)
        return out

    def make_row_invariant(self) -> None:
        """--batch-invariant: the shared expert's gate on a row-invariant GEMM (the router is a module
        of its own; the experts' projections are linear layers, chosen by select_backends)."""
        if self.shared_expert is not None:
            # the gate's one column 32 times: torch's sigmoid over a [T, 1] tensor runs its vector loop
            # over the first rows and a scalar tail (whose exp differs in the last bit) over the rows
            # past its last whole pair of vectors, so a row's gate depended on T; 32 wide, every row is
            # whole vectors on every ISA
            w = self.shared_expert_gate.weight
            self.shared_gate_linear = row_invariant_linear(w.expand(SHARED_GATE_WIDTH, -1).contiguous())

    def _native_experts(self):
        """The experts as one native call per step (``ops.native.moe_experts``), or None: only with the
        native op set and its one-call paths on (``FUSED_LAYERS``, as llama's decoder stack), and every
        expert projection on a method the native side applies (``fused_moe.native_plan``)."""
        ops = current_ops()
        if not getattr(ops, "FUSED_LAYERS", False) or not hasattr(ops, "moe_experts"):
            return None
        # A projection packed (set_backend) or replaced (quantization) anew rebuilds the plan. The
        # projections are read from the submodule dicts: nn.Module's attribute lookup (2 per expert)
        # cost ~0.3 ms a layer at 128 experts each step, more than the router.
        key = tuple([id(m.packed) for e in self.experts._modules.values()
                     for m in (e._modules["gate_up_proj"], e._modules["down_proj"])])
        plan = self.__dict__.get("_native_plan")
        if plan is None or plan[0] != key:
            plan = (key, native_plan(self.experts))
            self.__dict__["_native_plan"] = plan
        if plan[1] is None:
            return None
        flat, kinds = plan[1]
        width = self.experts[0].down_proj.in_features

        def run(x, ids, weights):
            self.native_calls += 1
            return ops.moe_experts(x, ids, weights, flat, kinds, width)
        return run


# checkpoint name pieces -> ours (Mixtral's block and expert names; Qwen's are ours already)
_RENAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))
_FUSED_3D = re.compile(r"^(.*\.(?:mlp|block_sparse_moe)\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?$")


class MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: MoeConfig):
        super().__init__(cfg)
        for layer, sparse in zip(self.model.layers, cfg.sparse_layers):
            if sparse:
                layer.mlp = SparseMoeBlock(cfg)

    def prepare(self, max_position: int, device: torch.device) -> None:
        """As llama's; then each expert's projections (float or, after quantization, quantized) are marked
        to have their linear method chosen at the rows an expert sees: ``top_k / num_experts`` of the
        step's (``share_of_probe_rows``), not the step's own."""
        super().prepare(max_position, device)
        cfg = self.config
        rows = share_of_probe_rows(cfg.num_experts_per_tok / cfg.num_experts)
        for m in self.modules():
            if isinstance(m, SparseMoeBlock):
                for expert in m.experts:
                    expert.gate_up_proj.probe_rows = expert.down_proj.probe_rows = rows

    def _fused_layers(self):
        # the one-call native decoder stack (ops.native.llama_layers) has no MoE feed-forward
        return None

    def param_for(self, name: str) -> tuple[str, str | None]:
        if ".experts." in name or ".block_sparse_moe." in name or ".shared_expert." in name:
            for a, b in _RENAMES:
                name = name.replace(a, b)
            for shard in ("gate_proj", "up_proj"):
                if f".{shard}." in name:
                    return name.replace(f".{shard}.", ".gate_up_proj."), shard
            return name, None
        return super().param_for(name)

    def split_checkpoint_tensor(self, name: str, value):
        """A fused 3-D expert tensor (transformers' in-memory layout) as per-expert checkpoint tensors;
        any other tensor as it is. Yields (name, value)."""
        m = _FUSED_3D.match(name)
        if m is None or not isinstance(value, torch.Tensor) or value.dim() != 3:
            yield name, value
            return
        prefix, kind = m.groups()
        cfg = self.config
        if value.shape[0] != cfg.num_experts:
            raise ModelLoadError(f"tensor {name!r} has {value.shape[0]} experts (dim 0 of {tuple(value.shape)}), "
                                 f"expected {cfg.num_experts} (from the model's config)")
        i = cfg.moe_intermediate_size
        for e in range(value.shape[0]):
            if kind == "down_proj":
                yield f"{prefix}.{e}.down_proj.weight", value[e]
            else:
                if value.shape[1] != 2 * i:
                    raise ModelLoadError(f"tensor {name!r} has shape {tuple(value.shape)}, expected "
                                         f"[{cfg.num_experts}, {2 * i}, {cfg.hidden_size}] (from the model's config)")
                yield f"{prefix}.{e}.gate_proj.weight", value[e, :i]
                yield f"{prefix}.{e}.up_proj.weight", value[e, i:]


# tensor parallel: attention as llama's; each expert's width split, router replicated (SparseMoeBlock)
supports_tensor_parallel = True


def parse_config(architecture: str, hf_config: dict) -> MoeConfig:
    return MoeConfig.from_hf(hf_config, ARCHS[architecture], architecture)


def check_tp_sizes(cfg: MoeConfig, tp: int) -> None:
    """llama's sizes (the dense layers' MLP too) and each expert's width (and the shared expert's)."""
    more = {"moe_intermediate_size": cfg.moe_intermediate_size}
    if cfg.shared_expert_intermediate_size:
        more["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    llama.check_tp_sizes(cfg, tp, more)


def build(architecture: str, hf_config: dict) -> MoeForCausalLM:
    return MoeForCausalLM(parse_config(architecture, hf_config))
