#!/usr/bin/env bash
# Build the engine in place on a machine without network access (the GPU hosts): CMake straight into
# weightsync/_ext, no pip. Needs cmake, a compiler, nanobind and the libfabric headers (see .device/).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(command -v "${PYTHON:-python3}")
case "$PY" in /*) ;; *) PY="$PWD/$PY" ;; esac  # absolute, but not resolved: a venv's python is a link
cmake -S . -B build/inplace -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$PY" >/dev/null
cmake --build build/inplace -j"$(nproc)" >/dev/null
cp build/inplace/_core*.so weightsync/_ext/
echo "built $(ls weightsync/_ext/_core*.so)"
