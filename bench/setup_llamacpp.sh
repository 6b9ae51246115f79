#!/usr/bin/env bash
# Creates bench/.llamacpp-venv with llama-cpp-python (llama.cpp compiled from the registry's source package),
# the CPU peer that bench/quant.py compares q4 against on the same GGUF.
# Usage: bench/setup_llamacpp.sh   (about 5 minutes on 2 cores; safe to re-run; exits 0 with a message if it
# cannot install, and the bench then reports llamacpp_* = null)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${BATCHINFER_LLAMACPP_VENV:-$here/.llamacpp-venv}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  echo "llama-cpp-python already installed in $venv"; exit 0
fi
python3 -m venv "$venv" || { echo "cannot create $venv; llama.cpp comparison unavailable"; exit 0; }
"$venv/bin/pip" install -q --upgrade pip
# NOTE: GGML_NATIVE builds for this CPU (-march=native), as our kernels are; no BLAS, OpenMP threads.
if ! CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$venv/bin/pip" install -q --no-cache-dir "llama-cpp-python==0.3.36"; then
  echo "llama-cpp-python==0.3.36 did not build here; benchmarks will report llamacpp_* = null"; exit 0
fi
"$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed in $venv')"
