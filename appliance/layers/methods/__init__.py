"""Linear methods, one class per backend, found by name through one registry (``base.REGISTRY``).

- ``floating``: ``torch``, ``onednn``, ``native`` (``Linear``)
- ``int8``: ``w8a8_onednn``, ``w8a16_int8pack``, ``w8a8_native`` (``QuantLinear``, scheme w8a8)
- ``int4``: ``w4a8_dynquant``, ``w4a16_int4pack`` (``QuantLinear``, scheme w4a8)
- ``lowbit``: ``w4a8_native`` (scheme w4a8), ``w6a8_native`` and ``w5a8_native`` (scheme w8a8, values within 6 / 5 bits)

Adding a method is one class with ``@register`` in one of these modules (or a new one imported
here) and its name in ``appliance.config.LINEAR_BACKENDS``, which stays torch-free for validating
the config; the two are checked against each other on import.
"""
from __future__ import annotations

from appliance.config import LINEAR_BACKENDS
# imported in this order, each registers its methods (a scheme's candidates are tried in it)
from appliance.layers.methods import floating, int8, int4, lowbit  # noqa: F401, I001
from appliance.layers.methods.base import REGISTRY, SCHEMES, FusedLinear, LinearMethod, get, of_scheme, register

__all__ = ["REGISTRY", "SCHEMES", "FusedLinear", "LinearMethod", "get", "of_scheme", "register"]

if set(REGISTRY) != set(LINEAR_BACKENDS[1:]):
    raise RuntimeError(f"appliance.config.LINEAR_BACKENDS {LINEAR_BACKENDS[1:]} and the registered linear methods "
                       f"{tuple(REGISTRY)} differ")
