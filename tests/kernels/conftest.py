"""Kernel tests: Triton runs under TRITON_INTERPRET=1 on the CPU (set in tests/conftest.py,
before any test module imports a kernel). benchmarks/gpu_kernels.py runs these tests on a CUDA
machine with TRITON_INTERPRET=0, where DEVICE becomes "cuda" and the same tests exercise the
compiled kernels.
"""

import os

import pytest
import torch

INTERPRET = os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on", "yes")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


@pytest.fixture(scope="session")
def triton_kernels():
    """The Triton backend: compiled on CUDA, interpreted on the CPU (set at the top of this file)."""
    from services.target.kernels import get_kernels

    if DEVICE == "cpu" and not INTERPRET:
        pytest.fail("Triton kernel tests need CUDA or TRITON_INTERPRET=1; do not set TRITON_INTERPRET=0 on a CPU machine")
    return get_kernels("triton")


@pytest.fixture(scope="session")
def ref_kernels():
    from services.target.kernels import get_kernels

    return get_kernels("reference")
