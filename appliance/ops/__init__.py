"""The kernel facade. Every op has a pure-torch reference (``reference.py``, the oracle); a native
backend implements the same functions with the same signatures. The choice is made once per engine
(``get_ops``), never per call.
"""
from __future__ import annotations

import os
from types import ModuleType

from appliance.ops import reference


def get_ops(backend: str = "auto", device_type: str = "cpu") -> ModuleType:
    """Return the module implementing the ops for ``backend``: ``reference``, ``native``, ``cuda``
    (Triton kernels, ``cuda_ops``) or ``auto`` (native when its extension is built and loads, else
    reference). On a CUDA device ``auto`` is ``cuda`` and the CPU kernels (``native``) are refused."""
    if device_type == "cuda":
        if backend == "native":
            raise RuntimeError("--attention-backend native: the native kernels are CPU kernels; "
                               "on --device cuda use auto, cuda or reference")
        if backend == "auto":
            backend = "cuda"
    if backend == "reference":
        return reference
    if backend == "cuda":
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"--attention-backend cuda on device {device_type}: the Triton kernels run on "
                               "a CUDA device (or on the CPU only under TRITON_INTERPRET=1, for tests)")
        try:
            from appliance.ops import cuda_ops
        except ImportError as e:
            raise RuntimeError(f"--attention-backend cuda: the Triton kernels cannot be imported ({e}); "
                               "pip install triton") from e
        return cuda_ops
    if backend in ("native", "auto"):
        try:
            from appliance.ops import native  # noqa: F401
        except ImportError:
            native = None
        if native is not None and native.is_available():
            return native
        if backend == "native":
            raise RuntimeError(
                "--attention-backend native: the native kernel extension is not available "
                f"({native.unavailable_reason() if native is not None else 'appliance.ops.native missing'})"
            )
        return reference
    raise ValueError(f"attention backend must be one of auto, native, reference, cuda; got {backend!r}")
