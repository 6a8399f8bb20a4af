"""The interpreter accepts code the GPU compiler may reject, so every kernel (a subset of
variants covering each compile-time flag) is also compiled for sm_90 (H100/H200) through
Triton's real NVIDIA pipeline, which runs without a GPU. Full matrix:
`TRITON_INTERPRET=0 python -m tests.kernels.compile_check`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.triton
def test_kernels_compile_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_check", "--quick", "90"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compiled" in proc.stdout
