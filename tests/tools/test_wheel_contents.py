"""A wheel of the project carries what the CPU kernel module is compiled from on the user's machine."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from services.target.kernels import cpu_linear

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_carries_the_kernel_sources(tmp_path):
    # Built from a copy: setuptools writes build/ and *.egg-info next to the sources.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".*cache",
                                                             ".hypothesis", "benchmarks", "docs", "tests"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src),
                    "-w", str(tmp_path)], check=True, cwd=tmp_path, timeout=300)
    (wheel,) = tmp_path.glob("specmesh-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = "services/target/kernels/"
    headers = Path(cpu_linear.__file__).parent.glob("*.h")
    needed = {kernels + Path(src).name for src in [*cpu_linear._SOURCES, *headers]}
    assert len(needed) >= 6  # four .cpp files, their headers
    assert needed <= names, f"missing from the wheel: {sorted(needed - names)}"
