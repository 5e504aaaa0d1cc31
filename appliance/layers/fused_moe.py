"""Mixture-of-experts compute: the router's top-k choice and the grouped expert pass.

Each expert is a gated MLP whose projections are the project's ``Linear`` (or ``QuantLinear`` after
quantization), so every linear method (float torch / oneDNN / native with its fused silu epilogue,
W8A8, W4A8) and every per-parameter loader applies to experts as to any other layer. Against stacked
``[E, ...]`` weights applied with ``F.linear`` per expert (one layer of 16 experts 2048 x 768, top-8,
one token, on the shared 2-core development host): 64 ms stacked, 64 ms as per-expert ``Linear`` on
the torch method, 37 ms on the native method (its prefetching GEMM with silu(gate) * up in the
epilogue), which a stacked layout would not reach without a per-expert variant of every method.

Per step the ``[T, top_k]`` expert ids are sorted once; the token rows are gathered in that order so
each expert's rows are one contiguous slice, and each chosen expert runs its gate/up and down
projections ONCE on its slice (a loop over the experts hit this step, never over tokens). The
results are gathered back into (token, slot) order, weighted by the routing weights and summed per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          weights_in_logits_dtype: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> (weights ``[T, top_k]``, expert ids ``[T, top_k]`` int64).

    As transformers 5.24 computes it: softmax in float32 over all experts, then top-k of the
    probabilities, then (``renormalize``: ``norm_topk_prob``; always for Mixtral) divided by their
    sum. Qwen2/3-MoE then cast the weights to the logits' dtype (``weights_in_logits_dtype``);
    Mixtral keeps them float32, so its weighted sum is taken in float32 before the cast back."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_in_logits_dtype:
        weights = weights.to(logits.dtype)
    return weights, ids


def row_invariant_linear(weight: torch.Tensor):
    """``x -> x @ weight.T`` with each row's result the same bits at every row count (--batch-invariant):
    the native float panel GEMM of the weight's dtype at every size, for the float projections that
    are not linear layers (the MoE router, the shared expert's gate). torch's GEMM picks its kernel and
    blocking by the row count: the router's logits, and so a token's expert weights, moved in the last
    bit with the step's size."""
    from appliance.errors import InvalidRequestError
    from appliance.layers import methods

    method = methods.get("native_bf16" if weight.dtype == torch.bfloat16 else "native")
    problem = method.host_problem(weight.dtype, weight.device)
    if problem is not None:
        raise InvalidRequestError(f"batch_invariant: the MoE router's {weight.dtype} weight has no row-invariant "
                                  f"GEMM here: {problem}", "batch_invariant")
    p = method.row_invariant_pack(method.pack(weight, None))
    return lambda x: method.apply(p, x)


class Router(nn.Module):
    """The gate: ``[E, hidden]`` float weight, kept float (never quantized: a quantized router
    could pick other experts than the checkpoint's)."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, renormalize: bool,
                 weights_in_logits_dtype: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.top_k, self.renormalize = top_k, renormalize
        self.weights_in_logits_dtype = weights_in_logits_dtype
        self.linear = None  # --batch-invariant: row_invariant_linear of the weight (make_row_invariant)

    def make_row_invariant(self) -> None:
        self.linear = row_invariant_linear(self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[T, hidden]`` -> (logits ``[T, E]``, weights ``[T, top_k]``, expert ids ``[T, top_k]``)."""
        logits = F.linear(x, self.weight) if self.linear is None else self.linear(x)
        weights, ids = route(logits, self.top_k, self.renormalize, self.weights_in_logits_dtype)
        return logits, weights, ids


def native_plan(experts: nn.ModuleList) -> tuple[list[torch.Tensor], list[int]] | None:
    """The experts as ``ops.native.moe_experts`` takes them (per expert its gate/up then its down
    projection: weight, bias, 3 aux tensors; and per projection its LinearKind and 3 ints), from their
    linear methods' ``fused_descriptor``; None when some projection has none. Under tensor parallel the
    experts are this rank's shards (gate_up ``column``, down ``row_partial``): their outputs need nothing
    from the other ranks until the block's one all-reduce, so the call takes them as they are; a layer
    that reduces or gathers itself (``row``, ``vocab``) is not taken."""
    empty = torch.empty(0)
    flat: list[torch.Tensor] = []
    kinds: list[int] = []
    for expert in experts:
        for lin in (expert.gate_up_proj, expert.down_proj):
            d = lin.fused_descriptor() if lin.tp_mode in (None, "column", "row_partial") else None
            if d is None:
                return None
            aux = tuple(d.aux) + (None,) * (3 - len(d.aux))
            flat += [d.weight, empty if d.bias is None else d.bias, *(empty if a is None else a for a in aux)]
            kinds += [d.kind, *(tuple(d.ints) + (0,) * (3 - len(d.ints)))]
    return flat, kinds


def grouped_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                    experts: nn.ModuleList) -> torch.Tensor:
    """sum over k of ``weights[t, k] * experts[expert_ids[t, k]](x[t])`` for every token t.

    x ``[T, hidden]``; expert_ids, weights ``[T, top_k]`` -> ``[T, hidden]`` in x's dtype. Each
    expert module is called as ``expert(rows)`` once, on all of its rows of this step."""
    t, k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the step's (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    token_of = torch.div(order, k, rounding_mode="floor")
    rows = x.index_select(0, token_of)  # [T * k, hidden], each expert's rows contiguous
    out_rows = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out_rows[start:start + n] = experts[e](rows[start:start + n])
            start += n
    # Each row weighted (in the weights' dtype, then rounded to x's, as transformers does), then summed
    # per token in increasing expert order, in x's dtype, as transformers' loop over experts adds them
    # (so bf16 results round alike). The rows are grouped by expert, so within a token its rows already
    # come in expert order: a stable sort by token gives (token, expert) order, and k adds sum them.
    # (index_add_ into the tokens did the same sums but cost milliseconds a call on the CPU.)
    w = weights.reshape(-1).index_select(0, order)
    contrib = (out_rows * w[:, None]).to(x.dtype)
    by_token = torch.argsort(token_of, stable=True)
    per_slot = contrib.index_select(0, by_token).view(t, k, contrib.shape[-1])  # (-1 is ambiguous at t = 0)
    out = per_slot[:, 0].clone()
    for j in range(1, k):  # top_k adds of [T, hidden] (a loop over slots, never over tokens)
        out += per_slot[:, j]
    return out
