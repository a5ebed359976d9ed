#!/usr/bin/env bash
# Regenerates the type stub of the compiled engine, weightsync/_ext/_core.pyi, from the built binding
# (nanobind's stubgen), formatted and lint-clean by the project's ruff settings. Rebuild the engine first.
#   scripts/gen_stubs.sh          rewrite the checked-in stub
#   scripts/gen_stubs.sh OUT.pyi  write it elsewhere (scripts/test.sh compares the two)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
RUFF=${RUFF:-.venv/bin/ruff}
out=${1:-weightsync/_ext/_core.pyi}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m nanobind.stubgen -q -m weightsync._ext._core -o "$tmp/_core.pyi"
# Formatted first (stubgen writes long lines), then the fixable lint (import order), then formatted again.
"$RUFF" format -q --no-cache --config pyproject.toml "$tmp/_core.pyi"
"$RUFF" check -q --no-cache --config pyproject.toml --fix "$tmp/_core.pyi"
"$RUFF" format -q --no-cache --config pyproject.toml "$tmp/_core.pyi"
cp "$tmp/_core.pyi" "$out"
