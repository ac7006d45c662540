#!/usr/bin/env bash
# The e2e cluster's real node: a kubelet that runs pods as containers, next to the KWOK nodes.
#
#   kubelet (built from the control plane's module tree) + containerd (Debian's, its own socket,
#   root and state) + runc + the CNI bridge plugin + kube-proxy (iptables) + CoreDNS (its Go
#   module), all inside one network namespace of their own, so their ports, iptables rules and
#   bridge touch neither the machine nor another developer's node.
#
# Usage: e2e/node.sh tools|up|down|status|env|load IMAGE...
#   tools   build kubelet, kube-proxy (cached with the control plane's binaries) and CoreDNS
#   up      start the node on the cluster e2e/cluster.sh runs (same state dir and ports)
#   load    copy images from podman's store into the node's containerd (skips those it has)
#   down    delete the node's pods, stop everything, remove mounts, namespaces and state
#   env     the node's name, network namespace and address (NAME=VALUE lines)
# See e2e/README.md ("The real node").
set -Eeuo pipefail
# shellcheck source=e2e/cluster.sh
source "$(dirname "$0")/cluster.sh"

COREDNS_VERSION="${WEIGHTSYNC_COREDNS_VERSION:-v1.15.0}"
# CoreDNS with only the plugins the node's Corefile uses (write_configs), from a tiny main module
# (build_coredns): upstream's main links every plugin (cloud SDKs, etcd, QUIC, ...), 11 minutes to
# build on 2 busy cores. The list keys the binary's folder: a plugin added here rebuilds it.
COREDNS_PLUGINS="bind cache errors health kubernetes template"
COREDNS_BIN="$CACHE/coredns-$COREDNS_VERSION/bin-$(printf '%s' "$COREDNS_PLUGINS" | sha256sum | cut -c1-8)"
NODE_NAME="${WEIGHTSYNC_E2E_NODE_NAME:-real-node-0}"
NODE_STATE="$STATE/node"
# One id per state dir names the namespace, the host's veth and the cgroup parent: two clusters on
# one machine get two nodes that share nothing.
NODE_ID="$(printf '%s' "$STATE" | sha256sum | cut -c1-6)"
NETNS="wsnode-$NODE_ID"
HOST_IF="wsnode$NODE_ID"
CGROUP_ROOT="/weightsync-node-$NODE_ID"
# Images stay across up/down (importing a multi-GB image takes minutes); everything else is state.
CONTAINERD_ROOT="$CACHE/node-$NODE_ID/containerd"
# Addresses: one /24 of 198.18.0.0/15 (reserved for network tests): pods in .0/25 (the bridge is
# .1, also CoreDNS's address), the link to the host .252/30 (host .253, node .254).
NET="${WEIGHTSYNC_E2E_NODE_NET:-198.19.200}"
POD_CIDR="$NET.0/25"
BRIDGE_IP="$NET.1"
HOST_IP="$NET.253"
NODE_IP="$NET.254"
KUBELET_PORT="${WEIGHTSYNC_E2E_KUBELET_PORT:-10250}"
KUBELET_HEALTHZ_PORT="${WEIGHTSYNC_E2E_KUBELET_HEALTHZ_PORT:-10248}"
PROXY_HEALTHZ_PORT="${WEIGHTSYNC_E2E_KUBE_PROXY_HEALTHZ_PORT:-10256}"
PROXY_METRICS_PORT="${WEIGHTSYNC_E2E_KUBE_PROXY_METRICS_PORT:-10249}"
DNS_PORT="${WEIGHTSYNC_E2E_DNS_PORT:-53}"
DNS_HEALTH_PORT="${WEIGHTSYNC_E2E_DNS_HEALTH_PORT:-8081}"
# What a GPU node of the pool says about itself, and a taint of its own so that only pods that ask
# for a real node land here (the KWOK tests' pods never try to run an image).
GPUS="${WEIGHTSYNC_E2E_NODE_GPUS:-4}"
NODE_LABELS="nvidia.com/gpu.present=true,nvidia.com/gpu.product=CPU-stand-in,weightsync.io/pool=gpu,weightsync.io/node=real"
NODE_TAINTS="nvidia.com/gpu=present:NoSchedule,weightsync.io/node=real:NoSchedule"
CTR_SOCK="$NODE_STATE/containerd.sock"
NODE_COMPONENTS="containerd kubelet kube-proxy coredns apiserver-link"

in_node() { nsenter --net="/run/netns/$NETNS" "$@"; }
ctr_() { ctr --address "$CTR_SOCK" --namespace k8s.io "$@"; }

# ================================================================ build
build_node() {
  if [[ ! -x "$K8S_BIN/kubelet" || ! -x "$K8S_BIN/kube-proxy" ]]; then
    log "building kubelet, kube-proxy $K8S_VERSION (cold: about 10 min on 2 cores)"
    local t0=$SECONDS
    go_build_k8s k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy
    log "built kubelet, kube-proxy in $((SECONDS - t0)) s -> $K8S_BIN"
  fi
  [[ -x "$COREDNS_BIN/coredns" ]] || build_coredns
}

build_coredns() {
  [[ -x "$GO" ]] || die "Go not found (set GO=/path/to/go)"
  local src="$CACHE/coredns-$COREDNS_VERSION/src" t0=$SECONDS
  mkdir -p "$src" "$COREDNS_BIN"
  log "building CoreDNS $COREDNS_VERSION (plugins: $COREDNS_PLUGINS)"
  printf 'module weightsync.local/e2e-coredns\n\ngo 1.26.0\n\nrequire github.com/coredns/coredns %s\n' \
    "$COREDNS_VERSION" > "$src/go.mod"
  cat > "$src/main.go" <<EOF
// The e2e node's CoreDNS: upstream's main (coredns.go) with only the plugins e2e/node.sh names.
package main

import (
	"github.com/coredns/coredns/coremain"
$(printf '\t_ "github.com/coredns/coredns/plugin/%s"\n' $COREDNS_PLUGINS)
)

func main() { coremain.Run() }
EOF
  (cd "$src" && CGO_ENABLED=0 "$GO" build -p "$(nproc)" -trimpath -ldflags "-s -w" -o "$COREDNS_BIN/coredns" .) \
    || die "building CoreDNS $COREDNS_VERSION failed"
  log "built CoreDNS in $((SECONDS - t0)) s -> $COREDNS_BIN/coredns"
}

node_deps() {
  local c
  for c in containerd runc ctr nsenter iptables socat /usr/lib/cni/bridge; do
    command -v "$c" >/dev/null 2>&1 || [[ -x "$c" ]] || die "$c not found: run tools/setup-containers.sh (apt)"
  done
  [[ $(id -u) == 0 ]] || die "the real node needs root (network namespace, mounts, cgroups)"
}

cmd_node_tools() {
  build_node
  echo "kubelet=$K8S_BIN/kubelet"
  echo "kube-proxy=$K8S_BIN/kube-proxy"
  echo "coredns=$COREDNS_BIN/coredns"
}

# ================================================================ network
net_up() {
  [[ -e "/run/netns/$NETNS" ]] && return 0
  if ip -4 route show table all | grep -qF "$NET."; then
    die "$NET.0/24 is in use on this machine: set WEIGHTSYNC_E2E_NODE_NET to a free /24 of 198.18.0.0/15 (e.g. 198.19.201)"
  fi
  ip netns add "$NETNS"
  ip link add "$HOST_IF" type veth peer name eth0 netns "$NETNS"
  ip addr add "$HOST_IP/30" dev "$HOST_IF"
  ip link set "$HOST_IF" up
  ip route add "$POD_CIDR" via "$NODE_IP" dev "$HOST_IF"
  ip -n "$NETNS" link set lo up
  ip -n "$NETNS" addr add "$NODE_IP/30" dev eth0
  ip -n "$NETNS" link set eth0 up
  ip -n "$NETNS" route add default via "$HOST_IP"
  # The CNI plugin adopts this bridge; it exists before the first pod so CoreDNS can bind its address.
  ip -n "$NETNS" link add cni0 type bridge
  ip -n "$NETNS" addr add "$BRIDGE_IP/25" dev cni0
  ip -n "$NETNS" link set cni0 up
  # Routing between pods and the host, and bridged pod-to-pod traffic through kube-proxy's rules
  # (a Service whose endpoint is on the same bridge). Both are per namespace.
  in_node sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1
}

net_down() {
  ip route del "$POD_CIDR" via "$NODE_IP" 2>/dev/null || true
  ip link del "$HOST_IF" 2>/dev/null || true
  if [[ -e "/run/netns/$NETNS" ]]; then ip netns del "$NETNS" || true; fi
}

# ================================================================ configuration
node_pki() {
  [[ -f "$PKI/node.crt" ]] && return 0
  sign_cert node "/O=system:nodes/CN=system:node:$NODE_NAME" "$PKI/client.ext"
  sign_cert kube-proxy "/CN=system:kube-proxy" "$PKI/client.ext"
  sign_cert coredns "/CN=weightsync-e2e-coredns" "$PKI/client.ext"
  chmod 600 "$PKI"/*.key
}

# node_kubeconfig FILE CERTNAME: the API server through the link (its certificate names "kubernetes").
node_kubeconfig() {
  write_kubeconfig "$1" "$2"
  sed -i "s#server: https://$HOST:$APISERVER_PORT#server: https://$HOST_IP:$APISERVER_PORT\n    tls-server-name: kubernetes#" "$1"
}

write_configs() {
  local d="$NODE_STATE"
  mkdir -p "$d/cni/net.d" "$d/cni/ipam" "$d/kubelet" "$d/containerd-state" "$CONTAINERD_ROOT" "$d/opt"
  node_kubeconfig "$d/kubelet.kubeconfig" node
  node_kubeconfig "$d/kube-proxy.kubeconfig" kube-proxy
  node_kubeconfig "$d/coredns.kubeconfig" coredns
  cat > "$d/containerd.toml" <<EOF
# containerd for the e2e node only: its own socket, root and state; no metrics or debug listener.
version = 2
root = "$CONTAINERD_ROOT"
state = "$d/containerd-state"
[grpc]
  address = "$CTR_SOCK"
[ttrpc]
  address = "$d/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "$d/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$(pause_image)"
  # The VM may not lower oom_score_adj: without this every sandbox fails ("can't get final child's PID").
  restrict_oom_score_adj = true
  disable_apparmor = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "$(command -v runc)"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$d/cni/net.d"
EOF
  cat > "$d/cni/net.d/10-weightsync.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "weightsync-node",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$d/cni/ipam",
              "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$BRIDGE_IP"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
  printf 'nameserver %s\n' "$BRIDGE_IP" > "$d/resolv.conf"
  cat > "$d/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This VM has hybrid cgroups (v1 controllers) and no systemd.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: $CGROUP_ROOT
containerRuntimeEndpoint: unix://$CTR_SOCK
address: $NODE_IP
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
clusterDNS: [$BRIDGE_IP]
clusterDomain: cluster.local
resolvConf: $d/resolv.conf
registerWithTaints:
$(IFS=, ; for t in $NODE_TAINTS; do k=${t%%=*}; v=${t#*=}; echo "- {key: $k, value: ${v%%:*}, effect: ${v#*:}}"; done)
# The disk and memory are shared with other work: evict only when nearly nothing is left, and never
# garbage-collect the images the tests loaded.
evictionHard: {memory.available: 200Mi, nodefs.available: 2%, imagefs.available: 2%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
maxPods: 60
# nothing outside the node's state dir
podLogsDir: $d/pod-logs
volumePluginDir: $d/volume-plugins
EOF
  cat > "$d/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection: {kubeconfig: $d/kube-proxy.kubeconfig}
hostnameOverride: $NODE_NAME
clusterCIDR: $POD_CIDR
bindAddress: $NODE_IP
healthzBindAddress: 127.0.0.1:$PROXY_HEALTHZ_PORT
metricsBindAddress: 127.0.0.1:$PROXY_METRICS_PORT
nodePortAddresses: [$NODE_IP/32]
# conntrack limits are machine-wide: leave them as they are.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
  cat > "$d/Corefile" <<EOF
cluster.local:$DNS_PORT in-addr.arpa:$DNS_PORT {
    bind $BRIDGE_IP
    errors
    health 127.0.0.1:$DNS_HEALTH_PORT
    kubernetes cluster.local in-addr.arpa {
        kubeconfig $d/coredns.kubeconfig weightsync-e2e
        pods insecure
        fallthrough in-addr.arpa
    }
    cache 5
}
.:$DNS_PORT {
    bind $BRIDGE_IP
    errors
    # Nothing outside the cluster is reachable from the node: answer at once instead of timing out.
    template ANY ANY {
        rcode NXDOMAIN
    }
}
EOF
}

# ================================================================ images
# The sandbox ("pause") image and the CPU images: images/build.sh lists them in $CACHE/images/cpu.env.
IMAGES_ENV="$CACHE/images/cpu.env"
built_image() {  # built_image NAME: the image images/build.sh built under NAME
  local image
  image=$(sed -n "s/^$1=//p" "$IMAGES_ENV" 2>/dev/null)
  [[ -n "$image" ]] || die "no $1 image in $IMAGES_ENV: run make images (images/build.sh) first"
  echo "$image"
}
pause_image() { built_image pause; }

# load IMAGE...: into the node's containerd, those it does not have yet, in one archive: images that
# share layers (trainer and inference share torch's gigabytes) carry them once.
cmd_load() {
  local image missing=() t0=$SECONDS
  for image in "$@"; do ctr_ images ls -q | grep -qxF "$image" || missing+=("$image"); done
  (( ${#missing[@]} )) || return 0
  log "loading ${missing[*]} into the node's containerd"
  podman save --multi-image-archive --format docker-archive "${missing[@]}" | ctr_ images import - >/dev/null \
    || die "loading ${missing[*]} failed"
  log "loaded them in $((SECONDS - t0)) s"
  # older builds of the same images go: their layers would otherwise fill the disk (containerd's
  # garbage collector removes what no image refers to any more)
  for image in "${missing[@]}"; do
    ctr_ images ls -q | grep "^${image%:*}:" | grep -vxF "$image" | xargs -r ctr_ images rm >/dev/null || true
  done
}

# ================================================================ lifecycle
# The node's pods share the cores with every other process on the machine. With cgroup v1 a cgroup
# weighs as much as one process in the root cgroup (cpu.shares 1024), and the kubelet nests all pods
# inside ours: two vLLM servers, their agents and proxies, a trainer and a coordinator would get one
# process's share (vLLM took 7 minutes to start on a busy machine). NODE_CPU_SHARES weighs the node
# as the dozen processes the same job runs as on the host (tests/e2e/test_real_sync.py).
NODE_CPU_SHARES="${WEIGHTSYNC_E2E_NODE_CPU_SHARES:-12288}"
cgroups_up() {
  local c
  for c in /sys/fs/cgroup/*/; do
    [[ -f "$c/cgroup.procs" ]] || continue
    mkdir -p "$c${CGROUP_ROOT#/}"
    if [[ -f "$c${CGROUP_ROOT#/}/cpu.shares" ]]; then echo "$NODE_CPU_SHARES" > "$c${CGROUP_ROOT#/}/cpu.shares"; fi
  done
}

cgroups_down() {  # deepest first; a cgroup with processes left is reported, not forced
  local c
  for c in /sys/fs/cgroup/*/; do
    [[ -d "$c${CGROUP_ROOT#/}" ]] || continue
    find "$c${CGROUP_ROOT#/}" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
}

node_ready() { kubectl_ get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' | grep -qx True; }

cmd_node_up() { or_undo node_up_inner node_up_failed; }

node_up_failed() {
  node_down
  echo "[node.sh] the node failed to come up; logs kept in $LOGS (e2e/node.sh down removes them)" >&2
}

node_up_inner() {
  local t0=$SECONDS
  node_deps
  cluster_healthy || die "the cluster is not up: run e2e/cluster.sh up first"
  build_node
  if node_healthy; then log "node $NODE_NAME already up"; return 0; fi
  pause_image >/dev/null
  mkdir -p "$NODE_STATE"
  node_pki
  write_configs
  net_up
  cgroups_up
  # The API server listens on loopback only; the node reaches it through the link's host address
  # (what a load balancer in front of the control plane is elsewhere). TLS end to end.
  start_component apiserver-link socat -lf "$LOGS/apiserver-link.socat.log" \
    "TCP-LISTEN:$APISERVER_PORT,bind=$HOST_IP,reuseaddr,fork" "TCP:$HOST:$APISERVER_PORT"
  start_component containerd nsenter --net="/run/netns/$NETNS" containerd --config "$NODE_STATE/containerd.toml"
  wait_for "containerd on $CTR_SOCK" 60 containerd ctr_ version
  cmd_load "$(pause_image)"
  # In-cluster clients reach the API server by the kubernetes Service: its endpoint is the link address.
  kubectl_ apply -f - >/dev/null <<EOF
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kubernetes
  namespace: default
  labels: {kubernetes.io/service-name: kubernetes, endpointslice.kubernetes.io/managed-by: weightsync-e2e-node}
addressType: IPv4
endpoints: [{addresses: ["$HOST_IP"], conditions: {ready: true}}]
ports: [{name: https, port: $APISERVER_PORT, protocol: TCP}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: weightsync-e2e-coredns}
rules:
- {apiGroups: [""], resources: [services, pods, namespaces], verbs: [list, watch]}
- {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: weightsync-e2e-coredns}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: weightsync-e2e-coredns}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: weightsync-e2e-coredns}]
EOF
  start_component kubelet nsenter --net="/run/netns/$NETNS" "$K8S_BIN/kubelet" \
    --config "$NODE_STATE/kubelet.yaml" --kubeconfig "$NODE_STATE/kubelet.kubeconfig" \
    --root-dir "$NODE_STATE/kubelet" --cert-dir "$NODE_STATE/kubelet/pki" \
    --hostname-override "$NODE_NAME" --node-ip "$NODE_IP" --node-labels "$NODE_LABELS" \
    --v=1
  start_component kube-proxy nsenter --net="/run/netns/$NETNS" "$K8S_BIN/kube-proxy" \
    --config "$NODE_STATE/kube-proxy.yaml" --v=1
  start_component coredns nsenter --net="/run/netns/$NETNS" "$COREDNS_BIN/coredns" \
    -conf "$NODE_STATE/Corefile" -pidfile ""
  wait_for "node $NODE_NAME Ready" 180 kubelet node_ready
  # GPUs as an extended resource (no device plugin: what the scheduler sees of a GPU node).
  kubectl_ patch node "$NODE_NAME" --subresource status --type merge \
    -p "{\"status\": {\"capacity\": {\"nvidia.com/gpu\": \"$GPUS\"}}}" >/dev/null
  wait_for "coredns health" 60 coredns in_node bash -c "exec 3<>/dev/tcp/127.0.0.1/$DNS_HEALTH_PORT"
  log "node $NODE_NAME up in $((SECONDS - t0)) s (pods $POD_CIDR, DNS $BRIDGE_IP)"
}

node_healthy() {
  local c
  for c in $NODE_COMPONENTS; do component_pid "$c" >/dev/null || return 1; done
  node_ready
}

cmd_node_status() {
  local c pid rc=0
  for c in $NODE_COMPONENTS; do
    if pid="$(component_pid "$c")"; then echo "$c: running (pid $pid)"; else echo "$c: not running"; rc=1; fi
  done
  if node_ready 2>/dev/null; then echo "node $NODE_NAME: Ready"; else echo "node $NODE_NAME: not Ready"; rc=1; fi
  return $rc
}

# Pods first (the kubelet tears their sandboxes and CNI down), then the processes, then whatever a
# killed process left: containers, shims, mounts, namespaces, cgroups.
node_down() {
  if component_pid kubelet >/dev/null && [[ -f "$KUBECONFIG_PATH" ]]; then
    kubectl_ delete pods -A --field-selector "spec.nodeName=$NODE_NAME" --grace-period 5 \
      --wait=false >/dev/null 2>&1 || true
    local i
    for i in $(seq 60); do
      [[ -z "$(ctr_ containers ls -q 2>/dev/null | grep -v '^$' || true)" ]] && break
      sleep 1
    done
  fi
  local c pid
  for c in coredns kube-proxy kubelet; do
    if pid="$(component_pid "$c")"; then kill -TERM "$pid" 2>/dev/null || true; fi
  done
  sleep 1
  if component_pid containerd >/dev/null; then
    local task
    for task in $(ctr_ tasks ls -q 2>/dev/null || true); do ctr_ tasks kill -s KILL "$task" >/dev/null 2>&1 || true; done
    sleep 1
    for task in $(ctr_ containers ls -q 2>/dev/null || true); do
      ctr_ tasks delete -f "$task" >/dev/null 2>&1 || true
      ctr_ containers delete "$task" >/dev/null 2>&1 || true
    done
  fi
  for c in coredns kube-proxy kubelet containerd apiserver-link; do
    if pid="$(component_pid "$c")"; then
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 50); do [[ -d "/proc/$pid" ]] || break; sleep 0.1; done
      kill -KILL "$pid" 2>/dev/null || true
      log "stopped $c"
    fi
  done
  # shims outlive containerd by design; ours name our socket
  for pid in $(pgrep -f "containerd-shim-runc-v2 .*-address $CTR_SOCK" || true); do kill -KILL "$pid" 2>/dev/null || true; done
  # mounts under the node's state and containerd's root (volumes, rootfs, network namespaces)
  local m
  for m in $(awk '{print $2}' /proc/self/mounts | grep -E "^($NODE_STATE|$CONTAINERD_ROOT)/" | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
  net_down
  cgroups_down
  if [[ -f "$KUBECONFIG_PATH" ]] && apiserver_ready; then
    # a Node left NotReady would make cluster.sh think the cluster is broken
    kubectl_ delete node "$NODE_NAME" --ignore-not-found --wait=false >/dev/null 2>&1 || true
    kubectl_ -n default delete endpointslice kubernetes --ignore-not-found >/dev/null 2>&1 || true
  fi
  # containerd's root keeps the images, not the containers' snapshots' mounts
  rm -rf "$NODE_STATE"
}

cmd_node_down() { node_down; log "node $NODE_NAME down"; }

node_main() {
  local cmd="${1:-}"; shift || true
  case "$cmd" in
    tools) cmd_node_tools "$@" ;;
    up) cmd_node_up "$@" ;;
    down) cmd_node_down "$@" ;;
    status) cmd_node_status "$@" || exit $? ;;
    load) node_deps; cmd_load "$@" ;;
    env) printf 'NODE_NAME=%s\nNODE_NETNS=%s\nNODE_IP=%s\n' "$NODE_NAME" "$NETNS" "$NODE_IP" ;;
    *) die "usage: $0 tools|up|down|status|env|load IMAGE..." ;;
  esac
}
node_main "$@"
