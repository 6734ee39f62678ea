#!/usr/bin/env bash
# Remakes tests/fixtures/hf/ with the pinned transformers and torch, in a
# venv kept out of the repository (HF_FIXTURE_VENV, default /tmp/hfenv).
# The default-index torch wheel is the CUDA build (~5 GB with its nvidia
# wheels); it runs on a machine without a GPU.
#   scripts/hf-fixtures/run.sh [FAMILY ...]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${HF_FIXTURE_VENV:-/tmp/hfenv}"
if ! "$venv/bin/python" -c 'import torch, transformers, safetensors' 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q -r "$here/requirements.txt"
fi
exec "$venv/bin/python" "$here/make_fixtures.py" "$@"
