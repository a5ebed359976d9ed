#!/usr/bin/env bash
# The project's checks: lint, then the test suite (the GPU tests skip themselves without GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
# The engine's stub must match the binding it describes.
stub=$(mktemp -d)
trap 'rm -rf "$stub"' EXIT
bash scripts/gen_stubs.sh "$stub/_core.pyi"
if ! diff -u weightsync/_ext/_core.pyi "$stub/_core.pyi" >"$stub/diff"; then
  cat "$stub/diff" >&2
  echo "weightsync/_ext/_core.pyi is stale (differs from the binding, above): run scripts/gen_stubs.sh and commit it" >&2
  exit 1
fi
# Test files run in parallel workers, each file whole in one worker (its module fixtures, such as its Ray
# cluster, start once): most of the suite's time is spent waiting (on timeouts, on other processes), which
# two workers overlap even on two cores. WEIGHTSYNC_TEST_WORKERS=0 runs the suite in one process, in order.
.venv/bin/python -m pytest -q -ra -n "${WEIGHTSYNC_TEST_WORKERS:-2}" --dist loadfile tests "$@"
# The vLLM backend's tests (tests/vllm) in vLLM's own environment, where scripts/setup_vllm.sh made it
# (.ci/run does); in .venv they skip, saying so. Only for a full run: arguments select main-suite tests.
if [ $# -eq 0 ] && [ -x .venv-vllm/bin/python ]; then
  .venv-vllm/bin/python -m pytest -q -ra -p no:cacheprovider tests/vllm
fi
# The SGLang backend's tests (tests/sglang) in SGLang's own environment, where scripts/setup_sglang.sh made
# it; likewise only for a full run.
if [ $# -eq 0 ] && [ -x .venv-sglang/bin/python ]; then
  .venv-sglang/bin/python -m pytest -q -ra -p no:cacheprovider tests/sglang
fi
