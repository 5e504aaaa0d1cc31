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
scales (``KQuantScales``) are split alike: by rows, or, row-parallel, by groups and super-blocks of
256 when each rank's part holds whole super-blocks; where it does not (e.g. 128 inputs a rank), the
rank's layer is packed from the fp32 group scales instead (same weights; logged). Note that A8 methods
quantize activations per token over the rank's slice of the input: a row-parallel W8A8 layer under
TP is the sum of per-rank A8 products, not bit-identical to the unsharded one (as in vLLM).
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from appliance.distributed.parallel_state import TPGroup, get_tp_group

log = logging.getLogger("appliance")

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
_fallbacks_said: set = set()


def _row_kquant(layer, kq, k: int, cut):
    """A row-parallel rank's part of a K-quant's scales: its groups' sub-scales and its super-blocks'
    scales, when its ``k`` inputs hold whole super-blocks; otherwise None (a super-block cut between
    ranks cannot keep one ``d``/``dmin`` per rank's part of it: the layer is packed from the plain
    fp32 group scales instead, exactly the same weights, more bytes held), which is logged once per
    shape and super-block."""
    if kq is None:
        return None
    if k % kq.super_block == 0:
        return dataclasses.replace(kq, sub=cut(kq.sub, kq.group), submin=cut(kq.submin, kq.group),
                                   sup=cut(kq.sup, kq.super_block), supmin=cut(kq.supmin, kq.super_block))
    key = (k, kq.super_block, layer.tp_group.world_size)
    if key not in _fallbacks_said:
        _fallbacks_said.add(key)
        log.warning("tensor_parallel_size=%d: a row-parallel layer's %d inputs per rank do not hold whole K-quant "
                    "super-blocks of %d; such layers keep fp32 group scales (the plain low-bit pack: the same "
                    "weights, more bytes) instead of the file's own scales", layer.tp_group.world_size, k,
                    kq.super_block)
    return None
