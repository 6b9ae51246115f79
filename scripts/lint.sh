#!/usr/bin/env bash
# Lint, format and type checks (ruff check, ruff format --check, mypy), configured in pyproject.toml.
# Run from anywhere; uses .venv when it exists (./scripts/setup.sh creates it with the lint tools).
# ./scripts/lint.sh --fix applies ruff's safe fixes and formats the tree instead of only checking.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
if [ "${1:-}" = "--fix" ]; then
    ruff check --fix .
    ruff format .
else
    ruff check .
    ruff format --check .
fi
mypy
