#!/usr/bin/env bash
# A third virtual environment, .venv-sglang, for the SGLang backend (weightsync.integrations.sglang) and
# its tests (tests/sglang): SGLang pins its own torch build, so it never goes into .venv or .venv-vllm.
# Idempotent: when SGLang and an up-to-date weightsync are already there it returns in a second or two.
# Needs scripts/setup.sh's system packages (libfabric-dev, a compiler) for weightsync's C++ engine.
set -euo pipefail
cd "$(dirname "$0")/.."

SGLANG_SPEC=${SGLANG_SPEC:-sglang==0.5.23}
VENV=.venv-sglang
PYTHON=${PYTHON:-python3}
# Installing and building on a shared machine: stay out of the way of interactive work.
NICE=(nice -n 10)

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"

want_version=${SGLANG_SPEC#sglang==}
have_version=$("$PY" -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null || true)
if [ "$have_version" != "$want_version" ]; then
  echo "setup_sglang: installing $SGLANG_SPEC into $VENV (large: SGLang pins its own torch)"
  "${NICE[@]}" "$PY" -m pip install -q -U pip
  # SGLang pins a torch newer than the cap some machines put on torch through a pip constraints file;
  # that cap is about the main environment, so it is lifted for this one only.
  PIP_CONSTRAINT="" "${NICE[@]}" "$PY" -m pip install -q "$SGLANG_SPEC"
fi

# weightsync itself, editable, in its own build directory (see setup_vllm.sh: the C++ extension links
# no torch, so the same sources serve every environment); rebuilt when the engine's sources or the set
# of Python packages changed since the last build here.
stamp="$VENV/.weightsync-engine-stamp"
engine_hash=$( (cat CMakeLists.txt pyproject.toml $(find cpp weightsync/_ext weightsync/delta -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.hpp' -o -name 'CMakeLists.txt' \) | sort); find weightsync -name __init__.py | sort) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$engine_hash" ] || ! "$PY" -c 'import weightsync.engine' 2>/dev/null; then
  echo "setup_sglang: building weightsync into $VENV"
  PIP_CONSTRAINT="" "${NICE[@]}" "$PY" -m pip install -q \
    --config-settings=build-dir="build/sglang-{wheel_tag}" -e ".[test]"
  echo "$engine_hash" >"$stamp"
fi
"$PY" -c "import importlib.metadata as m, weightsync.engine; print('sglang', m.version('sglang'), 'with weightsync ready:', weightsync.engine.__file__)"
