# specmesh image. CPU by default (the CPU build of torch: no CUDA libraries in the image):
#   docker build -t specmesh:latest .
# A GPU target image (CUDA runtime base, CUDA build of torch):
#   docker build -t specmesh:cuda --build-arg VARIANT=cuda .
ARG VARIANT=cpu

FROM python:3.11-slim AS base-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# g++ builds specmesh's AVX-512 CPU kernels (services/target/kernels/cpu_kernels.py) below.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 AS base-cuda
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126

FROM base-${VARIANT}
ARG VARIANT
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1

# Dependencies first, in their own layers: a code change does not reinstall them.
COPY pyproject.toml ./
RUN python -c "import re, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
torch = [d for d in deps if re.match(r'torch\b', d)]; open('/tmp/torch.txt', 'w').write('\n'.join(torch)); \
open('/tmp/deps.txt', 'w').write('\n'.join(d for d in deps if d not in torch))" \
    && pip install --index-url "$TORCH_INDEX_URL" -r /tmp/torch.txt \
    && pip install -r /tmp/deps.txt

# Then the code (installed without touching the dependencies above).
COPY README.md ./
COPY protos ./protos
COPY services ./services
COPY specmesh ./specmesh
COPY scripts ./scripts
COPY deploy ./deploy
RUN pip install --no-deps .

# The default model, converted once at build time into a path no volume mounts over
# (compose mounts its `models` volume at /models for your own model directories).
ENV SPECMESH_MODEL_CACHE=/opt/specmesh/models
RUN specmesh models prepare

# The CPU linear kernel, compiled once into the image where the build host has AVX-512 (elsewhere
# the engine compiles it on first use; the CUDA image has no compiler and skips it).
ENV TORCH_EXTENSIONS_DIR=/opt/specmesh/torch_extensions
RUN if [ "$VARIANT" = "cpu" ]; then python -m services.target.kernels.cpu_kernels; fi

EXPOSE 50051 50052 50053 50054 9464
CMD ["specmesh", "serve", "router", "--host", "0.0.0.0"]
