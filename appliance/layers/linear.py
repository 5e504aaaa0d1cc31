"""Linear layers. Fused projections (q/k/v, gate/up) are one GEMM whose weight is filled shard by
shard at load time. Quantized and prepacked backends plug in here (issue: dense and quantized
linear layers)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shards: dict[str, tuple[int, int]] | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        # shard name -> (row offset, rows): where each checkpoint tensor lands in a fused weight
        self.shards = shards or {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
