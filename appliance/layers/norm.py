"""RMSNorm through the step's op set (reference or native; ``forward_context.current_ops``)."""
from __future__ import annotations

import torch
from torch import nn

from appliance.layers.forward_context import current_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        ops = current_ops()
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class OffsetRMSNorm(nn.Module):
    """RMSNorm that scales by ``1 + weight`` (Gemma): checkpoints store the offset from 1, zero-initialized.

    The factor ``1 + w`` is formed once, in float32, as transformers forms it on every call
    (``1.0 + weight.float()``), and held apart from the parameter (``scale``), so a bfloat16 model
    multiplies by the same float32 factor; the ops' RMSNorm takes a float32 weight with any
    activation dtype. A GGUF stores the factor itself (``ShiftedWeight``): it is kept exactly."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps
        self.scale: torch.Tensor | None = None  # float32 1 + weight, set by finalize()
        self._stored_scale: torch.Tensor | None = None

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: str | None = None) -> None:
        from appliance.layers.weight_loading import ShiftedWeight, default_weight_loader

        if isinstance(loaded, ShiftedWeight) and loaded.shift == 1.0:
            self._stored_scale = loaded.value.float().clone()
        else:
            self._stored_scale = None
        default_weight_loader(param, loaded, shard_id)

    def finalize(self) -> None:
        """After loading and casting: the float32 factor the norm multiplies by."""
        w = self.weight
        self.scale = (self._stored_scale.to(w.device) if self._stored_scale is not None
                      else 1.0 + w.float())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        ops = current_ops()
        if residual is None:
            return ops.rms_norm(x, self.scale, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.scale, self.eps)
