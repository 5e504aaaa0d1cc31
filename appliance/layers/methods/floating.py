"""Float linear methods: ``torch``, ``onednn``, ``native`` (float32) and ``native_bf16`` (bfloat16).

Each packs ``(weight [N, K], bias [N] or None)`` of a float ``Linear`` and applies it to
``x [..., K]`` of the weight's dtype, giving ``[..., N]`` with the bias added. ``silu_mul``: the
layer is an MLP's [gate; up] projection, always followed by ``silu_and_mul`` (only ``native`` folds
it into its GEMM).
"""
from __future__ import annotations

import os
import platform

import torch
import torch.nn.functional as F

from appliance.layers.methods.base import FusedLinear, LinearMethod, native_extension_problem, register


def _native():
    from appliance.ops import native

    return native


def native_gemm_available(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype == torch.float32 and device.type == "cpu" and _native().is_available()


def native_bf16_gemm_available(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype == torch.bfloat16 and device.type == "cpu" and _native().is_available()


def onednn_available(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def pack_onednn(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 32)


class FloatMethod(LinearMethod):
    # fused_kind: LinearKind in native/neon_sve/bindings/torch_bindings.cpp (kLinNative 0, kLinOneDNN 1,
    # kLinTorch 2); the C++ side applies each as the method's ``apply`` does.
    scheme = "float"
    keeps_weight = False  # whether ``apply`` reads the layer's own weight (else it is released)

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool = False) -> dict:
        raise NotImplementedError

    def reference(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x.double(), weight.double(), None if bias is None else bias.double())

    def fused_silu_mul(self, p: dict) -> bool:
        """Whether ``p`` gives ``silu(gate) * up`` in its GEMM (``apply_silu_mul``)."""
        return False

    def fused_descriptor(self, p, silu_mul_next):
        return None if self.fused_kind is None else FusedLinear(self.fused_kind, p["w"], p["bias"])


@register
class TorchLinear(FloatMethod):
    """``F.linear`` on the checkpoint layout. ``pack`` keeps the layer's own parameters (by
    reference, so a weight tied to the embedding stays shared)."""

    name = "torch"
    fused_kind = 2
    keeps_weight = True

    def pack(self, weight, bias, silu_mul=False):
        return {"w": weight, "bias": bias}

    def apply(self, p, x):
        return F.linear(x, p["w"], p["bias"])



@register
class OneDNNLinear(FloatMethod):
    """The weight reordered once into oneDNN's blocked layout (``mkldnn._reorder_linear_weight``) and
    applied with ``mkldnn._linear_pointwise``. Where this reaches the hardware's GEMM better than the
    plain path (small decode batches on wide-vector CPUs, Neoverse with ACL) it is the faster one."""

    name = "onednn"
    fused_kind = 1

    def host_problem(self, dtype=torch.float32, device=torch.device("cpu")):
        if onednn_available(dtype, device):
            return None
        if device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return "torch is built without oneDNN (mkldnn)"
        if dtype == torch.bfloat16:
            return ("oneDNN's bfloat16 GEMM needs a CPU that computes bf16 natively: AVX512-BF16 or AMX on x86, "
                    "BF16 (BFMMLA) on Arm")
        return f"oneDNN takes float32 or bfloat16 layers, not {dtype}"

    def pack(self, weight, bias, silu_mul=False):
        return {"w": pack_onednn(weight), "bias": bias}

    def apply(self, p, x):
        return torch.ops.mkldnn._linear_pointwise(x, p["w"], p["bias"], "none", [], "")



# Rows of x above which ``native`` applies its panels with torch's batched GEMM (one [K, 32] panel
# per batch entry) instead of the native panel kernel. That kernel streams each panel from memory
# while it computes and is the fastest at decode rows (a step of a few to tens of requests, a
# speculative verify chunk); at prefill sizes a cache-blocked GEMM beats it. Both read the one packed
# weight, so the layer holds no second copy. The one-call decoder stack
# (``models.llama.cached_fused_plan``) leaves steps of more tokens than this to the per-op path when
# it holds a native layer. The default is where the kernel still at least ties the batched GEMM on
# the hosts it was measured on (bench/results/gemm_cold.txt: x86-64, 64 rows; Arm's NEON block, which
# takes rows in pairs, was not measured there and keeps 16).
# ``APPLIANCE_NATIVE_F32_MAX_ROWS`` moves the limit (read at import, so that tensor-parallel ranks
# started later see it too; the fused-stack tests raise it to hold the stack to the per-op path at
# every step size).
NATIVE_F32_MAX_ROWS_ENV = "APPLIANCE_NATIVE_F32_MAX_ROWS"
NATIVE_F32_DEFAULT_MAX_ROWS = 64 if platform.machine().lower() in ("x86_64", "amd64") else 16


def _max_rows_from_env() -> int:
    raw = os.environ.get(NATIVE_F32_MAX_ROWS_ENV, str(NATIVE_F32_DEFAULT_MAX_ROWS))
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 1:
        raise ValueError(f"{NATIVE_F32_MAX_ROWS_ENV} must be an integer >= 1; got {raw!r}")
    return value


NATIVE_F32_MAX_ROWS = _max_rows_from_env()


def _panel_rows(x: torch.Tensor) -> int:
    return x.numel() // max(1, x.shape[-1])


def _panels_matmul(p: dict, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T (+ bias)`` over ``pack_f32``'s panels ``[P, K, 32]`` with torch's batched GEMM (the
    columns in the packed order: ``[..., n]``)."""
    lead, n = x.shape[:-1], p["n"]
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.matmul(x2, p["w"])  # [P, M, 32]
    y = y.permute(1, 0, 2).reshape(x2.shape[0], -1)
    if y.shape[1] != n:
        y = y[:, :n]
    if p["bias"] is not None:
        y = y + p["bias"]
    return y.reshape(*lead, n)


@register
class NativeLinear(FloatMethod):
    """float32: the weight prepacked once into panels of 32 output columns and applied by the native
    extension's ``gemm_f32``, which prefetches each next panel while it computes the current one. At
    decode batch sizes the weights stream from DRAM every step; a kernel that does not fetch ahead
    stalls on them (oneDNN loses ~20-30% there on x86, see bench/results).

    A [gate; up] projection (``silu_mul``) is packed with its rows interleaved by ``gate_up_order``
    (16 gate rows and their 16 up rows per panel) so that ``apply_silu_mul`` gives ``silu(gate) * up``
    from the GEMM's epilogue; its plain ``apply`` puts the columns back."""

    name = "native"
    fused_kind = 0
    # 1: rows above NATIVE_F32_MAX_ROWS through torch's batched GEMM; 2: AVX2 register-blocked block;
    # 3: a row block's passes share the next panel's prefetch, 4 rows as 2 + 2 on AVX2, the kernel up
    # to 64 rows on x86-64
    revision = 3
    # each output is one k-ordered FMA chain of its row, however the kernel blocks the rows; with the
    # panel kernel at every size (row_invariant_pack), not torch's batched GEMM above the limit
    row_invariant = True

    def row_invariant_pack(self, p):
        return dict(p, every_size=True)

    @staticmethod
    def every_size(p) -> bool:
        """Whether a layer packed as ``p`` keeps the panel kernel at every row count."""
        return bool(p.get("every_size"))

    @classmethod
    def _batched(cls, p, x) -> bool:
        """Whether ``x`` takes torch's batched GEMM over the panels (a prefill-sized step)."""
        return not cls.every_size(p) and _panel_rows(x) > NATIVE_F32_MAX_ROWS

    def host_problem(self, dtype=torch.float32, device=torch.device("cpu")):
        if native_gemm_available(dtype, device):
            return None
        if dtype != torch.float32 or device.type != "cpu":
            return f"the native panel GEMM takes float32 layers on the CPU, not {dtype} on {device}"
        return native_extension_problem()

    def pack(self, weight, bias, silu_mul=False):
        if not native_gemm_available(weight.dtype, weight.device):
            raise ValueError("linear backend native needs float32 weights on the CPU and the native "
                             "kernel extension (python -m appliance.ops.native --build)")
        n = weight.shape[0]
        order = _native().gate_up_order(n // 2) if silu_mul and n % 2 == 0 else None
        if order is not None:
            weight = weight[order]
            bias = None if bias is None else bias[order].contiguous()
        return {"w": _native().pack_f32(weight), "bias": bias, "n": n,
                "unorder": None if order is None else torch.argsort(order)}

    def apply(self, p, x):
        if self._batched(p, x):
            y = _panels_matmul(p, x)
        else:
            y = _native().gemm_f32(x, p["w"], p["bias"], p["n"])
        # rows interleaved for silu_mul: put the columns back (not the MLP's path)
        return y if p["unorder"] is None else y[..., p["unorder"]]

    def apply_silu_mul(self, p, x):
        """``silu(gate) * up`` of a [gate; up] projection packed with ``silu_mul`` (``[..., n/2]``)."""
        if self._batched(p, x):
            y = _panels_matmul(p, x)
            h = _native().SGEMM_PANEL // 2  # each panel: 16 gate columns, then their 16 up columns
            y = y.view(*y.shape[:-1], -1, 2, h)
            return (F.silu(y[..., 0, :]) * y[..., 1, :]).flatten(-2)
        return _native().gemm_f32(x, p["w"], p["bias"], p["n"], silu_mul=True)

    def fused_silu_mul(self, p):
        return p["unorder"] is not None

    def fused_descriptor(self, p, silu_mul_next):
        # the stack applies a native gate/up weight with the silu epilogue: it must be packed for it
        if silu_mul_next and p["unorder"] is None:
            return None
        return FusedLinear(self.fused_kind, p["w"], p["bias"])


@register
class NativeBF16Linear(FloatMethod):
    """bfloat16: the weight prepacked once into bf16 panels of 32 output columns with pairs of k steps
    interleaved (``ops.native.pack_bf16``) and applied by the native extension's ``gemm_bf16``: the float32
    panel GEMM's work split and prefetch over half the bytes. Every variant reads the same panels:
    AVX512-BF16 multiplies them with VDPBF16PS and Arm BF16 cores with BFDOT; AVX2, AVX512, NEON, SVE
    and the portable build widen each word to its two fp32 weights (a shift and a mask) and FMA, so a
    host without bf16 arithmetic still streams half the bytes of float32 weights at decode.

    fp32 accumulation and one rounding of the output to bf16: what ``F.linear`` over the bf16 weights
    computes in fp32 (``reference``), to within fp32 summation order. The [gate; up] projection is not
    fused with silu: the stack and the MLP follow it with ``silu_and_mul``."""

    name = "native_bf16"
    fused_kind = 7  # kLinBF16
    revision = 1  # 1: a row block's passes share the next panel's prefetch (AVX2, NEON)
    row_invariant = True  # the panel kernel at every size, each output one k-ordered chain

    def host_problem(self, dtype=torch.float32, device=torch.device("cpu")):
        if native_bf16_gemm_available(dtype, device):
            return None
        if dtype != torch.bfloat16 or device.type != "cpu":
            return f"the native bf16 panel GEMM takes bfloat16 layers on the CPU, not {dtype} on {device}"
        return native_extension_problem()

    def pack(self, weight, bias, silu_mul=False):
        if not native_bf16_gemm_available(weight.dtype, weight.device):
            raise ValueError("linear backend native_bf16 needs bfloat16 weights on the CPU and the native "
                             f"kernel extension (python -m appliance.ops.native --build); got {weight.dtype} "
                             f"on {weight.device}")
        return {"w": _native().pack_bf16(weight), "bias": None if bias is None else bias.float().contiguous(),
                "n": weight.shape[0]}

    def apply(self, p, x):
        return _native().gemm_bf16(x, p["w"], p["bias"], p["n"])
