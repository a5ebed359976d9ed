#!/usr/bin/env bash
# A second virtual environment, .venv-vllm, for the vLLM backend (weightsync.integrations.vllm) and its
# tests (tests/vllm): vLLM brings its own, much larger torch build, so it never goes into .venv.
# Idempotent: when vLLM and an up-to-date weightsync are already there it returns in a second or two.
# Needs scripts/setup.sh's system packages (libfabric-dev, a compiler) for weightsync's C++ engine.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_SPEC=${VLLM_SPEC:-vllm==0.33.0}
VENV=.venv-vllm
PYTHON=${PYTHON:-python3}
# Installing and building on a shared machine: stay out of the way of interactive work.
NICE=(nice -n 10)

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"

want_version=${VLLM_SPEC#vllm==}
have_version=$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || true)
if [ "$have_version" != "$want_version" ]; then
  echo "setup_vllm: installing $VLLM_SPEC into $VENV (large: vLLM pins its own torch)"
  "${NICE[@]}" "$PY" -m pip install -q -U pip
  # vLLM pins a torch newer than the cap some machines put on torch through a pip constraints file; that
  # cap is about the main environment, so it is lifted for this one only.
  PIP_CONSTRAINT="" "${NICE[@]}" "$PY" -m pip install -q "$VLLM_SPEC"
fi

# weightsync itself, editable, built in its own build directory so that it never shares CMake state
# with .venv's build. Its C++ extension links no torch, so the same sources serve both environments;
# it is rebuilt when the engine's sources changed since the last build here, or the set of Python
# packages did (the editable install maps the packages it saw when it was made).
stamp="$VENV/.weightsync-engine-stamp"
engine_hash=$( (cat CMakeLists.txt pyproject.toml $(find cpp weightsync/_ext weightsync/delta -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.hpp' -o -name 'CMakeLists.txt' \) | sort); find weightsync -name __init__.py | sort) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$engine_hash" ] || ! "$PY" -c 'import weightsync.engine' 2>/dev/null; then
  echo "setup_vllm: building weightsync into $VENV"
  PIP_CONSTRAINT="" "${NICE[@]}" "$PY" -m pip install -q \
    --config-settings=build-dir="build/vllm-{wheel_tag}" -e ".[test]"
  echo "$engine_hash" >"$stamp"
fi
"$PY" -c "import importlib.metadata as m, weightsync.engine; print('vllm', m.version('vllm'), 'with weightsync ready:', weightsync.engine.__file__)"
