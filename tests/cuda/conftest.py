"""The CUDA op set's tests run on the GPU when there is one and under the Triton interpreter on the
CPU otherwise. ``triton.jit`` reads TRITON_INTERPRET when it decorates a kernel, so it is set here,
before any test module imports appliance.ops.triton_kernels. (triton is in the `test` extra; the
modules that need it skip, with that reason, where it is missing.)"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cuda_device import DEVICE  # noqa: E402


@pytest.fixture
def device() -> str:
    return DEVICE
