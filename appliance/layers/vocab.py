"""The vocabulary-sized pair: the token embedding table held quantized (``QuantEmbedding``) and the
logits projection tied to an embedding (``tied_lm_head``), for every architecture that ties them.

A model builds its embedding as a ``VocabEmbedding`` (an ``nn.Embedding``); the loader swaps in a ``QuantEmbedding``
when the weight source gives the table quantized (a GGUF's ``token_embd`` of a kept type, see
``appliance.models.gguf_quants``), so the table stays in the file's W8/W4 group form instead of
float32 (a 151936 x 896 vocabulary: 545 MB as float32, 138 MB as the file's Q8_0). A lookup
dequantizes only the gathered rows.

A model whose lm_head is tied calls ``tied_lm_head(embedding)`` once its weights are loaded: a float
``Linear`` on the embedding's own weight, or for a ``QuantEmbedding`` a ``QuantLinear`` on the same
canonical tensors, so the logits projection (read in full every decode step) runs on a quantized
linear method, like any other layer. The table is then held once: when the head's method can give
back rows of its packed form (``QuantMethod.dequantize_rows``: ``w8a8_native``'s tiles), the canonical
copy is released after packing and the embedding reads its rows from the head; otherwise (the opaque
W4 packings) the embedding keeps the canonical copy and the head holds its packed one.
"""
from __future__ import annotations

import torch
from torch import nn


class VocabEmbedding(nn.Embedding):
    """``nn.Embedding`` without its random initialisation: its table always comes from a checkpoint,
    and on the meta device (where models are built) ``nn.init.normal_`` runs through torch's
    decompositions, whose first use imports ``torch._dynamo``: 5-7 s of every start-up here.

    ``tp=True``: vocabulary-parallel in the tensor-parallel group it is built in (``appliance.layers.parallel``):
    the rank holds rows ``[vocab_start, vocab_start + num_embeddings)``, looks up the ids it holds, zeroes the
    others' rows and sums over ranks (each id's row comes from exactly one rank, plus zeros: exact)."""

    shards: dict = {}  # none; what appliance.layers.parallel's row cutting reads

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: bool = False):
        from appliance.layers import parallel

        holder = _TPHolder()
        _, local, _ = parallel.setup(holder, "vocab" if tp else None, embedding_dim, num_embeddings, None)
        super().__init__(local, embedding_dim)
        self.tp_mode, self.tp_group = holder.tp_mode, holder.tp_group
        self.vocab_start = self.tp_group.rank * local if self.tp_mode else 0

    def reset_parameters(self) -> None:
        pass

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: str | None = None) -> None:
        """The rank's rows of the table (all of it outside tensor parallelism)."""
        from appliance.layers.weight_loading import _rank_part, default_weight_loader

        default_weight_loader(param, _rank_part(self, param, loaded, shard_id), shard_id)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(self, input_ids, super().forward)


class _TPHolder:
    """What ``parallel.setup`` sets before ``nn.Module.__init__`` may set attributes."""

    tp_mode = None
    tp_group = None


def vocab_parallel_lookup(layer, input_ids: torch.Tensor, lookup) -> torch.Tensor:
    """``lookup(ids)`` of an embedding that may hold only a slice of the vocabulary (``tp_mode``)."""
    if getattr(layer, "tp_mode", None) is None:
        return lookup(input_ids)
    start = layer.vocab_start
    inside = (input_ids >= start) & (input_ids < start + layer.num_embeddings)
    rows = lookup(torch.where(inside, input_ids - start, 0))
    rows.masked_fill_(~inside.unsqueeze(-1), 0)
    return layer.tp_group.communicator.all_reduce_(rows)


class QuantEmbedding(nn.Module):
    """An embedding table ``[num_embeddings, embedding_dim]`` in the canonical quantized form
    (``appliance.layers.quant``): ``qweight`` int8, ``weight_scale`` float32 ``[V, H // group_size]``
    and, for W4 and W8 groups, ``weight_zero_point`` of that shape: ``w = (q - zero_point) * scale``.
    ``forward(input_ids [T]) -> [T, H]`` in ``dtype`` (the model dtype; ``loader.cast_float`` sets
    it): each row dequantized in fp64 and rounded once, so a row equals the fp32 dequantization of
    its weights."""

    # a checkpoint's "<name>.weight" (a QuantizedWeight record) fills qweight, scale and zero point
    checkpoint_aliases = {"weight": "qweight"}

    def __init__(self, num_embeddings: int, embedding_dim: int, scheme: str, group_size: int):
        super().__init__()
        if embedding_dim % group_size:
            raise ValueError(f"quant_group_size={group_size} does not divide the embedding size {embedding_dim}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.scheme, self.group_size = scheme, group_size
        g = embedding_dim // group_size
        self.qweight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=torch.int8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(num_embeddings, g, dtype=torch.float32), requires_grad=False)
        # 0 for symmetric blocks (the loader zeroes it; a record without zero points leaves it)
        self.weight_zero_point = nn.Parameter(torch.zeros(num_embeddings, g, dtype=torch.float32),
                                              requires_grad=False)
        self.bias = None  # what load_quant_linear checks a float tensor against
        self.shards: dict = {}
        self.dtype = torch.float32
        self._rows_from = None  # the tied QuantLinear once it released the canonical tensors (tied_lm_head)

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: str | None = None) -> None:
        """A ``QuantizedWeight`` of the whole table (``appliance.layers.weight_loading``)."""
        from appliance.layers.weight_loading import load_quant_linear

        load_quant_linear(self, param, loaded, shard_id)

    tp_mode = None  # set by the loader (parallel.inherit) for a vocabulary-parallel table
    vocab_start = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(self, input_ids, self._lookup)

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        if self.qweight.numel() == 0:  # released: the tied head's packed form holds the table
            head = self._rows_from
            if head is None or head.packed is None:
                raise RuntimeError("QuantEmbedding: its canonical tensors are released but no packed lm_head holds them")
            rows = head.method.dequantize_rows(head.packed, ids)
        else:
            rows = self.dequantize_rows(ids)
        return rows.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), H]: ``(q - zero_point) * scale`` of the rows ``ids``, in fp64, rounded once."""
        from appliance.layers.methods.qmath import dequantize

        return dequantize(self.qweight[ids], self.weight_scale[ids], self.weight_zero_point[ids]).float()

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in (self.qweight, self.weight_scale, self.weight_zero_point))

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.scheme}, group={self.group_size}"
                + (", rows from the tied lm_head" if self.qweight.numel() == 0 else ""))


def tied_lm_head(embedding: nn.Module) -> nn.Module:
    """The logits projection ``hidden -> vocab`` sharing ``embedding``'s table (built once per
    embedding; a second call returns the same head). A float ``nn.Embedding``: a ``Linear`` on its
    weight (the linear methods may pack a copy; the weight itself stays). A ``QuantEmbedding``: a
    ``QuantLinear`` on its canonical tensors, which the head releases after packing when its method
    gives rows back (``dequantize_rows``); the embedding then reads its rows from the head."""
    from appliance.layers.linear import Linear
    from appliance.layers.quant import QuantLinear

    head = embedding.__dict__.get("_tied_head")  # not a submodule: the model owns the head as lm_head
    if head is not None:
        return head
    if isinstance(embedding, QuantEmbedding):
        e = embedding
        with torch.device("meta"):  # its tensors are the embedding's; allocate nothing
            head = QuantLinear(e.embedding_dim, e.num_embeddings, e.scheme, e.group_size,
                               w8_groups=e.scheme == "w8a8")
        head.qweight, head.weight_scale, head.weight_zero_point = e.qweight, e.weight_scale, e.weight_zero_point
        head.__dict__["tied_embedding"] = e  # not a submodule (the model owns it as the embedding)
    else:
        w = embedding.weight
        head = Linear(w.shape[1], w.shape[0])
        head.weight = w
        head.keep_weight = True
    from appliance.layers.parallel import inherit

    inherit(head, embedding)  # a vocabulary-parallel table: the head's logits are this rank's slice, gathered
    embedding.__dict__["_tied_head"] = head
    return head
