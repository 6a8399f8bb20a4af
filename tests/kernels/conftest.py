"""Kernel tests: Triton runs under TRITON_INTERPRET=1 on the CPU.

The variable must be set before any Triton kernel module is imported (@triton.jit picks
interpreted or compiled kernels at import time), hence at the very top of this file.
benchmarks/gpu_kernels.py runs these tests on a CUDA machine with TRITON_INTERPRET=0,
where DEVICE becomes "cuda" and the same tests exercise the compiled kernels.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

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
