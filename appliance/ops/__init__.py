"""The kernel facade. Every op has a pure-torch reference (``reference.py``, the oracle); a native
backend implements the same functions with the same signatures. The choice is made once per engine
(``get_ops``), never per call.
"""
from __future__ import annotations

from types import ModuleType

from appliance.ops import reference


def get_ops(backend: str = "auto") -> ModuleType:
    """Return the module implementing the ops for ``backend``: ``reference``, ``native``, ``cuda``
    (Triton kernels, ``cuda_ops``) or ``auto`` (native when its extension is built and loads, else
    reference)."""
    if backend == "reference":
        return reference
    if backend == "cuda":
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
