"""Tensor-parallel sharding of linear layers and the vocabulary (Megatron's split, as vLLM does it).

A layer is built with its full (checkpoint) sizes and a ``tp`` mode; in a tensor-parallel group
(``appliance.distributed.parallel_state``) it holds only this rank's part:

- ``column``: output rows split (q/k/v by heads, gate/up, each shard of a fused weight split
  alike); the output stays split: the next layer is row-parallel (or attention over local heads).
- ``row``: input columns split; each rank's partial product is summed by an all-reduce. A bias is
  held by rank 0 only (the others hold zeros), so the sum adds it once.
- ``row_partial``: split as ``row``, but the partial product is returned as it is: the caller
  sums several such layers' outputs and all-reduces once (the experts of an MoE block and its
  shared expert: one all-reduce per block, not one per expert).
- ``vocab``: the logits projection, output rows split by vocabulary; the logits are gathered.

The rank's part is cut in the per-parameter weight loaders (``rank_part``), so every weight source
(safetensors, compressed-tensors, AWQ/GPTQ, GGUF) shards alike, float or quantized. Quantized
row-parallel layers split on group boundaries (a group size that does not divide the rank's part
of the input is refused at load); per-channel scales are whole on every rank. A GGUF K-quant's own
scales (``KQuantScales``) are split alike: by rows, or, row-parallel, by groups and super-blocks
(a rank whose inputs cut a super-block of 256 holds finer ones, each with its file super-block's
``d``/``dmin``: ``_row_kquant``). Note that A8 methods
quantize activations per token over the rank's slice of the input: a row-parallel W8A8 layer under
TP is the sum of per-rank A8 products, not bit-identical to the unsharded one (as in vLLM).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from appliance.distributed.parallel_state import TPGroup, get_tp_group

TP_MODES = ("column", "row", "row_partial", "vocab")
ROW_MODES = ("row", "row_partial")


def setup(layer, mode: str | None, in_features: int, out_features: int,
          shards: dict[str, tuple[int, int]] | None) -> tuple[int, int, dict[str, tuple[int, int]]]:
    """Set ``layer.tp_mode`` / ``layer.tp_group`` from the current group and return this rank's
    (in_features, out_features, shards). ``shards`` are the full (checkpoint) row ranges; each one
    is split alike, so shard offsets are the full ones divided by the group size."""
    if mode is not None and mode not in TP_MODES:
        raise ValueError(f"tp must be one of {', '.join(TP_MODES)} or None; got {mode!r}")
    group = get_tp_group() if mode else TPGroup()
    layer.tp_mode, layer.tp_group = (mode if group.is_parallel else None), group
    shards = dict(shards or {})
    if not group.is_parallel:
        return in_features, out_features, shards
    n = group.world_size
    if mode in ROW_MODES:
        return group.shard(in_features, "the layer's input size")[1], out_features, shards
    for name, (off, rows) in shards.items():
        group.shard(rows, f"the rows of {name}")
    shards = {name: (off // n, rows // n) for name, (off, rows) in shards.items()}
    return in_features, group.shard(out_features, "the layer's output size")[1], shards


def inherit(dst, src) -> None:
    """``dst`` (a layer swapped in for ``src`` with ``src``'s local sizes) takes its sharding."""
    dst.tp_mode, dst.tp_group = getattr(src, "tp_mode", None), getattr(src, "tp_group", TPGroup())


def finish(layer, y: torch.Tensor) -> torch.Tensor:
    """The layer's output as the next layer needs it: summed over ranks (row), gathered (vocab), this
    rank's partial sum (row_partial: the caller all-reduces)."""
    mode = layer.tp_mode
    if mode == "row":
        return layer.tp_group.communicator.all_reduce_(y)
    if mode == "vocab":
        return layer.tp_group.communicator.all_gather(y, dim=-1)
    return y


def _rows(t: torch.Tensor, layer, shard_id: str | None) -> torch.Tensor:
    """This rank's rows of a column-split checkpoint tensor (its shard ``shard_id`` or, for a
    fused tensor stored whole, every shard's part, in the layer's order)."""
    g = layer.tp_group
    if shard_id is None and layer.shards:
        parts = [t.narrow(0, off * g.world_size + g.rank * rows, rows) for off, rows in layer.shards.values()]
        return torch.cat(parts, dim=0)
    rows = layer.shards[shard_id][1] if shard_id is not None else t.shape[0] // g.world_size
    if t.shape[0] != rows * g.world_size:
        from appliance.layers.weight_loading import WeightLoadError

        raise WeightLoadError(f"has {t.shape[0]} rows, expected {rows * g.world_size} "
                              f"(split over tensor_parallel_size={g.world_size})")
    return t.narrow(0, g.rank * rows, rows)


def _cols(t: torch.Tensor, layer, k_full: int) -> torch.Tensor:
    g = layer.tp_group
    if t.shape[-1] != k_full:
        from appliance.layers.weight_loading import WeightLoadError

        raise WeightLoadError(f"has {t.shape[-1]} input columns, expected {k_full} "
                              f"(split over tensor_parallel_size={g.world_size})")
    k = k_full // g.world_size
    return t.narrow(-1, g.rank * k, k)


def rank_part(layer, param: torch.Tensor, loaded, shard_id: str | None):
    """This rank's part of a checkpoint value (a float tensor or a ``QuantizedWeight``) for
    ``param`` of ``layer``; the value itself outside tensor parallelism."""
    from appliance.layers.weight_loading import QuantizedWeight, WeightLoadError

    mode = getattr(layer, "tp_mode", None)
    if mode is None:
        return loaded
    g = layer.tp_group
    if mode in ("column", "vocab"):
        if isinstance(loaded, QuantizedWeight):
            zp = loaded.zero_point
            rows = lambda t: None if t is None else _rows(t, layer, shard_id)  # noqa: E731
            kq = loaded.kquant
            if kq is not None:  # a K-quant's row tables follow the rows
                kq = dataclasses.replace(kq, **{f: rows(getattr(kq, f)) for f in _KQ_TABLES})
            return QuantizedWeight(rows(loaded.qweight), rows(loaded.scale), rows(zp), loaded.group_size,
                                   loaded.scheme, kq)
        return _rows(loaded, layer, shard_id)
    # row, row_partial: split the input dimension; a bias (1-D) is added once, by rank 0
    if not isinstance(loaded, QuantizedWeight):
        if loaded.dim() == 1:
            return loaded if g.rank == 0 else torch.zeros_like(loaded)
        return _cols(loaded, layer, layer.in_features * g.world_size)
    k_full = layer.in_features * g.world_size
    k = layer.in_features
    q = _cols(loaded.qweight, layer, k_full)
    if loaded.scale.shape[1] == 1:  # one scale per output channel: every rank holds it whole
        return QuantizedWeight(q, loaded.scale, loaded.zero_point, k, loaded.scheme)
    if k % loaded.group_size:
        raise WeightLoadError(f"has groups of {loaded.group_size} inputs, which do not split at "
                              f"tensor_parallel_size={g.world_size} (each rank's {k} inputs must hold whole groups)")
    zp = loaded.zero_point

    def cut(t, group):  # this rank's columns of a per-group table
        if t is None:
            return None
        n = k // group
        return t.narrow(1, g.rank * n, n)

    return QuantizedWeight(q, cut(loaded.scale, loaded.group_size), cut(zp, loaded.group_size), loaded.group_size,
                           loaded.scheme, _row_kquant(layer, loaded.kquant, k, cut))


# KQuantScales' per-row tables (``appliance.models.gguf_quants``)
_KQ_TABLES = ("sub", "submin", "sup", "supmin")


def _row_kquant(layer, kq, k: int, cut):
    """A row-parallel rank's part of a K-quant's scales: its groups' sub-scales and its super-blocks'
    scales. Where its ``k`` inputs do not hold whole super-blocks (128 inputs a rank against 256, or
    384 starting half-way through one), its part is held at super-blocks of ``gcd(S, k)`` inputs,
    each within one of the file's and holding that one's ``d``/``dmin``: the same weights, one more
    fp32 (two with mins) per ``gcd(S, k)`` inputs instead of per ``S``."""
    if kq is None:
        return None
    sub, submin = cut(kq.sub, kq.group), cut(kq.submin, kq.group)
    s = math.gcd(kq.super_block, k)  # a multiple of the group, which divides both
    if s == kq.super_block:
        return dataclasses.replace(kq, sub=sub, submin=submin, sup=cut(kq.sup, s), supmin=cut(kq.supmin, s))
    first = layer.tp_group.rank * k  # the rank's first input
    which = (first + torch.arange(k // s) * s) // kq.super_block  # the file's super-block of each piece
    pick = lambda t: None if t is None else t[:, which].contiguous()  # noqa: E731
    return dataclasses.replace(kq, super_block=s, sub=sub, submin=submin, sup=pick(kq.sup), supmin=pick(kq.supmin))
