"""Which torch device the engine runs on (``--device``) and, on CUDA, how much device memory the KV
cache gets (``--gpu-memory-utilization``, vLLM's meaning: the fraction of the GPU's total memory
this engine may use, weights and activations included)."""
from __future__ import annotations

import torch

from appliance.config import DEVICES
from appliance.errors import InvalidRequestError


def _cuda_findings() -> str:
    # what torch found, for the refusal: a CPU-only build, no driver, or no visible device
    built = torch.version.cuda
    if not built:
        return f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"
    try:
        count = torch.cuda.device_count()
    except Exception as e:  # a broken driver raises here
        return f"torch {torch.__version__} (CUDA {built}) cannot query devices: {e}"
    return f"torch {torch.__version__} (CUDA {built}) sees {count} CUDA device(s), torch.cuda.is_available() is False"


def resolve_device(requested: str, cuda_available: bool | None = None) -> torch.device:
    """``auto``: CUDA when torch can use a GPU, else the CPU. ``cuda`` without a usable GPU is
    refused here, at start, rather than failing inside the first kernel."""
    if requested not in DEVICES:
        raise InvalidRequestError(f"device must be one of {', '.join(DEVICES)}; got {requested!r}", "device")
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if requested == "auto":
        return torch.device("cuda" if cuda_available else "cpu")
    if requested == "cuda" and not cuda_available:
        raise InvalidRequestError(f"--device cuda: no usable CUDA GPU: {_cuda_findings()}", "device")
    return torch.device(requested)


def check_dtype_on_device(dtype: torch.dtype, device: torch.device, bf16_supported: bool | None = None) -> None:
    """Refuse at start a dtype the GPU cannot run (bfloat16 before compute capability 8.0)."""
    if device.type != "cuda" or dtype is not torch.bfloat16:
        return
    if bf16_supported is None:
        bf16_supported = torch.cuda.is_bf16_supported()
    if not bf16_supported:
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "this GPU"
        raise InvalidRequestError(f"dtype bfloat16: {name} cannot run bfloat16; use --dtype float32", "dtype")


def activation_reserve_bytes(hidden: int, intermediate: int, q_kv_width: int, vocab: int,
                             max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """An upper estimate of one step's peak activations, left out of the KV budget (no profiling
    run: a step's tensors are few and their sizes known). Per token of the step budget, float32:
    residual, normed and attention output (3 x hidden), the qkv projection, gate/up and the MLP
    product (3 x intermediate); per sampled sequence: logits, their softmax and a sampler copy."""
    per_token = 3 * hidden + q_kv_width + 3 * intermediate
    return 4 * (max_num_batched_tokens * per_token + 3 * max_num_seqs * vocab)


def gpu_kv_budget_bytes(free: int, total: int, utilization: float, reserve: int) -> int:
    """Bytes the KV cache may take: ``utilization * total`` minus what is already in use on the
    device (weights, this process's and other processes' allocations: ``total - free``) minus the
    activation reserve. Refuses a budget that holds nothing, naming the numbers."""
    if not 0 < utilization <= 1:
        raise InvalidRequestError(f"gpu_memory_utilization must be in (0, 1], got {utilization}",
                                  "gpu_memory_utilization")
    GiB = 1 << 30
    used = total - free
    budget = int(utilization * total) - used - reserve
    if budget <= 0:
        raise InvalidRequestError(
            f"gpu_memory_utilization={utilization} of {total / GiB:.2f} GiB leaves no KV cache: "
            f"{used / GiB:.2f} GiB already in use and {reserve / GiB:.2f} GiB reserved for activations",
            "gpu_memory_utilization")
    return budget
