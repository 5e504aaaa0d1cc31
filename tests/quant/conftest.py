"""The native kernels are built (cached) before these tests are collected: ``w8a8_native`` is a
quantized backend candidate only when they are (tests/ops/conftest.py does the same for the kernels)."""
from __future__ import annotations

from appliance.ops import native

if not native.is_available():
    native._ext, native._reason = native.build(), None
