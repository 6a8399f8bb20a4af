"""A wheel of the project carries what the CPU kernel module is compiled from on the user's machine."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from services.target.kernels import cpu_linear

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_carries_the_kernel_sources(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(ROOT),
                    "-w", str(tmp_path)], check=True, cwd=tmp_path, timeout=300)
    (wheel,) = tmp_path.glob("specmesh-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = "services/target/kernels/"
    needed = {kernels + Path(src).name for src in cpu_linear._SOURCES} | {kernels + "cpu_simd.h"}
    assert needed <= names, f"missing from the wheel: {sorted(needed - names)}"
