#!/usr/bin/env bash
# image.sh BINARY NAME OUT.tar writes the kube-portal-proxy image as an OCI image layout tarball
# without a container engine (make image-oci): the Debian root filesystem rootfs.sh makes
# (cached under $KPP_CACHE/images, keyed by rootfs.sh's content) as the first layer, and the
# static binary and the kube-proxy symlink as the second, with the Dockerfile's ENTRYPOINT.
# dockerfile_test.go checks BINARY_PATH, SYMLINK and ENTRYPOINT against the Dockerfile.
#
#   ctr -n k8s.io images import OUT.tar     (or: docker load -i OUT.tar)
set -euo pipefail

BINARY_PATH=/usr/local/bin/kube-portal-proxy
SYMLINK=/usr/local/bin/kube-proxy=kube-portal-proxy
ENTRYPOINT=/usr/local/bin/kube-portal-proxy

bin=${1:?usage: image.sh BINARY NAME OUT.tar}
name=${2:?usage: image.sh BINARY NAME OUT.tar}
out=${3:?usage: image.sh BINARY NAME OUT.tar}
here=$(cd "$(dirname "$0")" && pwd)
cache=${KPP_CACHE:-${HOME:?HOME or KPP_CACHE must be set}/.cache/kube-portal-proxy}/images
key=$(sha256sum "$here/rootfs.sh" | cut -c1-12)
rootfs=$cache/kube-portal-proxy-rootfs-$key.tar

mkdir -p "$cache"
if [ ! -f "$rootfs" ]; then
  echo "image.sh: building the Debian root filesystem (mmdebstrap, ~2 min) into $rootfs" >&2
  "$here/rootfs.sh" "$rootfs"
fi
mkdir -p "$(dirname "$out")"
go run "$here" -o "$out" -name "$name" -base "$rootfs" \
  -add "$bin=$BINARY_PATH" -symlink "${SYMLINK%%=*}=${SYMLINK#*=}" -entrypoint "$ENTRYPOINT"
echo "$out: $name"
