#!/usr/bin/env bash
# Makes the root file system of the CPU images' base from the Debian registry (no image registry is
# reachable on these machines) and writes it as a tarball for `podman import`.
#
#   images/cpu/rootfs.sh OUT.tar
#
# bookworm minbase plus Python 3.11 (the python:3.11 images' version) and its venv module; the
# machine's CA certificates are added, so pip and uv inside a build trust what this machine trusts
# (a TLS-intercepting egress proxy's CA, where there is one). The mirror is the one apt uses here.
set -euo pipefail
out=${1:?usage: rootfs.sh OUT.tar}
SUITE=bookworm
PACKAGES=python3,python3-venv,ca-certificates,libnuma1
need() { command -v "$1" >/dev/null || { echo "rootfs.sh: $1 not found: run tools/setup-containers.sh" >&2; exit 1; }; }
need debootstrap
mirror=$(sed -n 's/^URIs: *\([^ ]*\/debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
[[ -n "$mirror" ]] || mirror=$(awk '$1=="deb" && $3=="'"$SUITE"'" {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
[[ -n "$mirror" ]] || { echo "rootfs.sh: no Debian mirror found in apt's sources" >&2; exit 1; }
root=$(mktemp -d "${TMPDIR:-/tmp}/weightsync-rootfs.XXXXXX")
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$mirror" >"$root.log" 2>&1 \
  || { tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
  chroot "$root" update-ca-certificates >/dev/null
fi
# apt's lists and caches are not needed at run time
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
tar --numeric-owner -C "$root" -cf "$out.tmp" .
mv "$out.tmp" "$out"
