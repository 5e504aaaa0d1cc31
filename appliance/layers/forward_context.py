"""The per-step state attention layers read: batch metadata and the KV cache (one object per step,
set by the model runner around ``model.forward``)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context incl. this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    # True when no sequence has cached context: attention needs only this step's K/V
    is_prefill_only: bool = False


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (key_cache, value_cache)
    ops: ModuleType
    # quantized KV caches (--kv-cache-dtype int8/fp8): per layer (k_scale, v_scale), float32
    # [num_blocks, num_kv_heads, block_size] (appliance.ops.reference.kv_scale_shape); else None
    kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None


_current: ForwardContext | None = None


def current_ops() -> ModuleType:
    """The op set (reference, native or CUDA) of the step running now: modules read it here rather than
    take it as an argument, so the runner is its one source."""
    return get_forward_context().ops


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention called outside a model runner step (no forward context set)")
    return _current


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext):
    global _current
    prev, _current = _current, ctx
    try:
        yield
    finally:
        _current = prev
