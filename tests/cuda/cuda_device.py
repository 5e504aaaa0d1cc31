"""The device tests/cuda runs on: the GPU when torch can use one, else the CPU (kernels under the
Triton interpreter, which tests/cuda/conftest.py turns on). A module of its own, not conftest: test
modules import it, and several test directories have a conftest."""
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
