#!/usr/bin/env bash
# Run a command on the GPU host (the device tool) with weightsync's Python dependencies carried as wheels.
#   carry: .whl/base (grpcio, protobuf, pydantic, prometheus-client, PyYAML, pytest-timeout; cp312)
#          .whl/nixl (optional: nixl 1.5.1 + nixl-cu13 without its torch-2.12+ expert-parallel extensions: a zip of
#                     the cp312 wheels' nixl/, nixl_meta_utils.py, nixl_cu13/, nixl_cu13.libs/ and the hidden
#                     .nixl_cu13.mesonpy.libs/, which holds libnixl.so; 24 MB)
#          .whl/cke (optional: checkpoint-engine 0.4.2, pyzmq, fastapi, httpx, loguru, safetensors and their deps;
#                    bench/moonshot_checkpoint_engine.py)
#   usage: bash tools/gpu-host.sh python3 -m pytest tests/gpu
set -euo pipefail
# NVLink multicast stays off on shared hosts (the device tool's KINDS.md says why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SITE=/tmp/site
if [[ ! -f $SITE/.done ]]; then
  mkdir -p "$SITE"
  shopt -s nullglob
  for w in .whl/base/*.whl .whl/nixl/*.whl .whl/cke/*.whl; do python3 -m pip install -q --no-index --no-deps --target "$SITE" "$w"; done
  for z in .whl/nixl/*.zip; do python3 -m zipfile -e "$z" "$SITE"; done
  touch "$SITE/.done"
fi
export PYTHONPATH=".:trainer:inference:operator:$SITE${PYTHONPATH:+:$PYTHONPATH}"
exec "$@"
