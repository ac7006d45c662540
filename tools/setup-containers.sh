#!/usr/bin/env bash
# Installs, from the Debian registry, what the images and the e2e cluster's real node need:
# podman (builds the images), runc (the only OCI runtime that accepts this VM's hybrid cgroups;
# crun refuses them), containerd (the node's runtime), the CNI plugins, debootstrap (the local
# base image: no image registry is reachable here), iptables and conntrack (kube-proxy), socat
# (the node reaches the loopback-only API server through it). Idempotent: a present command
# skips its package; the apt index is refreshed only when something is missing.
set -euo pipefail
declare -A want=(
  [podman]=podman [runc]=runc [containerd]=containerd [ctr]=containerd
  [/usr/lib/cni/bridge]=containernetworking-plugins [debootstrap]=debootstrap
  [iptables]=iptables [conntrack]=conntrack [socat]=socat [nsenter]=util-linux
)
missing=()
for cmd in "${!want[@]}"; do
  if [[ "$cmd" == /* ]]; then [[ -x "$cmd" ]] && continue; else command -v "$cmd" >/dev/null 2>&1 && continue; fi
  missing+=("${want[$cmd]}")
done
(( ${#missing[@]} )) || exit 0
[[ $(id -u) == 0 ]] || { echo "setup-containers: missing ${missing[*]}: run as root (apt-get)" >&2; exit 1; }
echo "setup-containers: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# --no-install-recommends: podman's recommends pull crun, slirp4netns, buildah's docs; none is used.
apt-get install -y -qq --no-install-recommends $(printf '%s\n' "${missing[@]}" | sort -u) >/dev/null
