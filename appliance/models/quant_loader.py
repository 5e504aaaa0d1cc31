"""Kept for its callers: the quantized and the float checkpoints load through one path now
(``appliance.models.loader.load``; formats in ``appliance.models.weight_sources``)."""
from __future__ import annotations

from appliance.models.loader import load  # noqa: F401
from appliance.models.weight_sources import QuantSpec, parse_compressed_tensors  # noqa: F401
