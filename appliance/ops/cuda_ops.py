"""The CUDA op set: the same functions and signatures as ``appliance.ops.reference``, with the KV
cache write and paged attention on the Triton kernels (``triton_kernels``) and the elementwise ops
in torch (the reference's own code: on a GPU torch's fused elementwise kernels are already
bandwidth-bound, and one home per formula keeps them identical to the oracle).

Selected with ``--attention-backend cuda`` (or ``auto`` on a CUDA device). On a CPU the kernels only
run under the Triton interpreter (``TRITON_INTERPRET=1`` before import), which the tests use.
"""
from __future__ import annotations

from appliance.ops.reference import (  # noqa: F401  (re-exported: this module is an op set)
    argmax,
    fused_add_rms_norm,
    gelu_and_mul,
    kv_cache_shape,
    rms_norm,
    rotary_cos_sin_cache,
    rotary_embedding,
    silu_and_mul,
    softmax_scale,
)
from appliance.ops.triton_kernels import paged_attention, reshape_and_cache  # noqa: F401

# Prefill reads its fresh K/V back from the cache through the one paged kernel too: it handles
# prefill, chunked prefill and decode alike, so prefill-only steps need no second attention path.
PAGED_PREFILL = True
# No whole-layer fused kernel: the per-op path runs (see LlamaModel.prepare).
FUSED_LAYERS = False


def is_available() -> bool:
    return True  # importing this module (triton) succeeded


def unavailable_reason() -> str:
    return ""
