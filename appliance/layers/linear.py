"""Linear layers and their kernel backends.

Fused projections (q/k/v, gate/up) are one GEMM whose weight is filled shard by shard at load
time. After loading, each layer gets one backend, chosen once per weight shape (never per step):

- ``torch``: ``F.linear`` on the checkpoint layout.
- ``onednn``: the weight reordered once into oneDNN's blocked layout
  (``mkldnn._reorder_linear_weight``) and applied with ``mkldnn._linear_pointwise``. Where this
  reaches the hardware's GEMM better than the plain path (small decode batches on wide-vector CPUs,
  Neoverse with ACL) it is the faster one.

``auto`` times the candidates on the real shapes at decode and prefill batch sizes and keeps the
fastest, remembering the choice per host, torch build, dtype and shape in the user cache.
Quantized backends (W8A8, W4A8) plug in here as further candidates.
"""
from __future__ import annotations

import json
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("appliance")

from appliance.config import LINEAR_BACKENDS
# Batch sizes (rows of x) a choice is timed at: single-sequence decode, batched decode, prefill.
_PROBE_ROWS = (1, 32, 256)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shards: dict[str, tuple[int, int]] | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        # shard name -> (row offset, rows): where each checkpoint tensor lands in a fused weight
        self.shards = shards or {}
        self.backend = "torch"
        self._packed: torch.Tensor | None = None
        self.keep_weight = False  # True when the weight is shared (tied embeddings)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def set_backend(self, name: str) -> None:
        if name == "onednn":
            self._packed = _pack_onednn(self.weight.data)
            if not self.keep_weight:  # the checkpoint layout is no longer needed for the forward pass
                self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
        elif name != "torch":
            raise ValueError(f"linear backend must be one of {', '.join(LINEAR_BACKENDS)}; got {name!r}")
        self.backend = name

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, backend={self.backend}"


def _pack_onednn(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 32)


def onednn_available(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def _time(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(weight: torch.Tensor, candidates: list[str]) -> dict[str, float]:
    """Summed best-of-5 seconds of each candidate over the probe batch sizes, on this weight's shape."""
    n, k = weight.shape
    w = torch.randn(n, k, dtype=weight.dtype, device=weight.device) * 0.02
    out = {}
    with torch.inference_mode():
        for name in candidates:
            if name == "onednn":
                packed = _pack_onednn(w)
                f = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
            else:
                f = lambda x: F.linear(x, w)  # noqa: E731
            out[name] = sum(_time(lambda: f(torch.randn(m, k, dtype=w.dtype, device=w.device))) for m in _PROBE_ROWS)
    return out


def _choice_cache_path():
    from appliance.config import cache_dir

    return cache_dir() / "linear_backends.json"


def select_backends(model: nn.Module, requested: str, dtype: torch.dtype, device: torch.device) -> dict[str, str]:
    """Give every Linear of ``model`` a backend; returns ``{"KxN": backend}`` for the banner/doctor."""
    if requested not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}; got {requested!r}")
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    candidates = ["torch"] + (["onednn"] if onednn_available(dtype, device) else [])
    if requested == "onednn" and "onednn" not in candidates:
        raise ValueError(f"linear_backend=onednn is not available for dtype {dtype} on this CPU")
    choices: dict[tuple[int, int], str] = {}
    if requested != "auto":
        choices = {tuple(m.weight.shape): requested for m in layers}
    elif len(candidates) == 1:
        choices = {tuple(m.weight.shape): "torch" for m in layers}
    else:
        from appliance.runtime.cpu_features import detect

        path = _choice_cache_path()
        try:
            cache = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            cache = {}
        host = f"{detect().model_name}|{torch.__version__}|{torch.get_num_threads()}t|{str(dtype)}"
        dirty = False
        for m in layers:
            shape = tuple(m.weight.shape)
            key = f"{host}|{shape[0]}x{shape[1]}"
            if shape in choices:
                continue
            if key not in cache:
                times = measure(m.weight, candidates)
                cache[key] = min(times, key=times.get)
                log.info("linear %s: %s -> %s", shape, {k: f"{v * 1e3:.2f}ms" for k, v in times.items()}, cache[key])
                dirty = True
            choices[shape] = cache[key]
        if dirty:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(cache, indent=1))
            except OSError as e:
                log.warning("could not save linear backend choices to %s: %s", path, e)
    for m in layers:
        m.set_backend(choices[tuple(m.weight.shape)])
    return {f"{k}x{n}": v for (n, k), v in choices.items()}
