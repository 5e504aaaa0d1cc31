"""Shared fixtures for the kernel tests: the native extension is built (cached) before collection
so every variant this CPU supports becomes a test parameter; none is skipped."""
from __future__ import annotations

import pytest

from appliance.ops import native


def ensure_built() -> None:
    if not native.is_available():
        # Build it here rather than skip: CI must exercise the kernels.
        native._ext, native._reason = native.build(), None


def _variants() -> list[str]:
    ensure_built()
    return native.available_variants()


@pytest.fixture(scope="session", autouse=True)
def _native_built():
    ensure_built()


def pytest_generate_tests(metafunc):
    if "variant" in metafunc.fixturenames:
        metafunc.parametrize("variant", _variants(), indirect=True)


@pytest.fixture
def variant(request):
    with native.use_variant(request.param):
        yield request.param
