#!/usr/bin/env bash
# One command for a fresh Debian/Ubuntu machine: system packages, a virtual environment in .venv,
# and weightsync built from source (the C++ engine compiles during `pip install -e .`).
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
need=()
pkg-config --exists libfabric 2>/dev/null || need+=(libfabric-dev)
command -v fi_info >/dev/null || need+=(libfabric-bin)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v ip >/dev/null && command -v tc >/dev/null || need+=(iproute2)
command -v g++ >/dev/null || need+=(g++)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q -U pip
# A CPU build of torch is enough for everything but the GPU paths; override with TORCH_SPEC.
.venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e ".[test,plot]"
.venv/bin/python -c "import weightsync, weightsync.engine; print('weightsync ready:', weightsync.__file__)"
# The vLLM backend's environment (.venv-vllm, large: vLLM brings its own torch), on request; CI makes it.
if [ "${WEIGHTSYNC_VLLM:-0}" = 1 ]; then
  bash scripts/setup_vllm.sh
fi
