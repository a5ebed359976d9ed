#!/usr/bin/env bash
# The project's checks: lint, then the test suite (the GPU tests skip themselves without GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -ra tests "$@"
