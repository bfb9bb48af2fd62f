#!/usr/bin/env bash
# images.sh AGNHOST_BINARY REGRESSION_74839_BINARY OUT_DIR writes the e2e test images the
# sig-network specs run, as OCI image layout tarballs (hack/oci), into OUT_DIR — no registry, no
# container engine:
#
#   agnhost.tar  registry.k8s.io/e2e-test-images/agnhost:2.63.0  the static agnhost binary on a
#                Debian minbase (dash as /bin/sh, bash, curl, wget, netcat-openbsd, and
#                busybox-static for the utilities minbase lacks: nslookup, ip, ping), /agnhost-2, the users and
#                groups the specs name; entrypoint /agnhost, command pause (as upstream)
#   busybox.tar  registry.k8s.io/e2e-test-images/busybox:1.37.0-1  busybox-static and its applets
#   nginx.tar    registry.k8s.io/e2e-test-images/nginx:1.15-4       a stand-in: the agnhost image
#                serving HTTP on port 80 (agnhost netexec); the specs that use it only need a
#                running pod that answers on 80
#   regression-issue-74839.tar  registry.k8s.io/e2e-test-images/regression-issue-74839:1.4  the
#                static boom-server (build.sh builds it from test/images of the same Kubernetes)
#                on the agnhost image's Debian minbase (upstream: debian-base bookworm), entrypoint
#                /regression-issue-74839 (the Conntrack invalid-state spec)
#   distroless-iptables.tar  registry.k8s.io/build-image/distroless-iptables:v0.9.6  a stand-in
#                with the tools of the upstream image: iptables (nft and legacy), ip6tables,
#                conntrack and ipset on a Debian minbase (which also gives the spec its
#                /bin/sh, cat, grep and sleep; the KubeProxy CLOSE_WAIT spec's host exec pod)
#
# The Debian layer is made by mmdebstrap (root, the Debian mirror) and cached under
# $KPP_CACHE/images keyed by its packages.
# Environment: KPP_CACHE, KPP_DEBIAN_MIRROR, KPP_DEBIAN_SECURITY_MIRROR.
set -euo pipefail

usage="usage: images.sh AGNHOST_BINARY REGRESSION_74839_BINARY OUT_DIR"
agnhost=${1:?$usage}
regression=${2:?$usage}
out=${3:?$usage}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${KPP_CACHE:-${HOME:?HOME or KPP_CACHE must be set}/.cache/kube-portal-proxy}/images
mirror=${KPP_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${KPP_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

E2E_REGISTRY=registry.k8s.io/e2e-test-images
AGNHOST_IMAGE=$E2E_REGISTRY/agnhost:2.63.0
BUSYBOX_IMAGE=$E2E_REGISTRY/busybox:1.37.0-1
NGINX_IMAGE=$E2E_REGISTRY/nginx:1.15-4
REGRESSION_IMAGE=$E2E_REGISTRY/regression-issue-74839:1.4
IPTABLES_IMAGE=registry.k8s.io/build-image/distroless-iptables:v0.9.6
IPTABLES_PACKAGES="iptables conntrack ipset"
PACKAGES="bash curl wget netcat-openbsd busybox-static"
# Utilities the specs call that minbase does not have, served by busybox. Not wget: bookworm's
# static busybox wget dies of SIGSEGV with -T (the timeout the Services specs pass); GNU wget.
BUSYBOX_APPLETS="nslookup ip ping"
# The cached Debian layers are keyed by what goes into them (change ROOTFS_REVISION with the hooks).
ROOTFS_REVISION=1
key=$(echo "$PACKAGES|$BUSYBOX_APPLETS|$ROOTFS_REVISION" | sha256sum | cut -c1-12)
rootfs=$cache/agnhost-rootfs-$key.tar
busybox_rootfs=$cache/busybox-rootfs-$key.tar
iptables_rootfs=$cache/iptables-rootfs-$(echo "$IPTABLES_PACKAGES|$ROOTFS_REVISION" | sha256sum | cut -c1-12).tar

log() { printf 'conformance-images: %s\n' "$*" >&2; }

# debian_rootfs TAR PACKAGES [MMDEBSTRAP_OPTION...]: a bookworm minbase with PACKAGES (no manual
# pages, documentation or locales) as the tarball TAR.
debian_rootfs() {
  local tar=$1 packages=$2
  shift 2
  command -v mmdebstrap >/dev/null 2>&1 || { log "mmdebstrap not found (apt-get install mmdebstrap)"; exit 1; }
  mmdebstrap --variant=minbase --mode=root --format=tar --include="${packages// /,}" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    "$@" bookworm "$tar.tmp" \
    "deb $mirror bookworm main" "deb $mirror bookworm-updates main" "deb $security bookworm-security main"
  mv -f "$tar.tmp" "$tar"
}

mkdir -p "$cache" "$out"
if [ ! -f "$rootfs" ]; then
  log "building the agnhost image's Debian root filesystem (mmdebstrap, ~2 min) into $rootfs"
  hooks=(--customize-hook='chroot "$1" groupadd -g 50000 group-defined-in-image'
    --customize-hook='chroot "$1" useradd -u 1000 -g 50000 -M -d / -s /bin/sh user-defined-in-image'
    # nc is netcat-openbsd (the specs pass -u, -v -t -z), never busybox's.
    --customize-hook='chroot "$1" update-alternatives --set nc /bin/nc.openbsd')
  for a in $BUSYBOX_APPLETS; do
    hooks+=(--customize-hook="ln -sf /bin/busybox \"\$1/usr/local/bin/$a\"")
  done
  debian_rootfs "$rootfs" "$PACKAGES" "${hooks[@]}"
fi
if [ ! -f "$iptables_rootfs" ]; then
  log "building the distroless-iptables stand-in's Debian root filesystem (mmdebstrap) into $iptables_rootfs"
  debian_rootfs "$iptables_rootfs" "$IPTABLES_PACKAGES"
fi
if [ ! -f "$busybox_rootfs" ]; then
  # busybox's own image: the static busybox out of the agnhost root filesystem, every applet a
  # symlink to it in /bin, and /tmp.
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/root/bin" "$tmp/root/tmp" "$tmp/root/etc"
  chmod 1777 "$tmp/root/tmp"
  tar -xf "$rootfs" -C "$tmp" ./bin/busybox ./usr/bin/busybox 2>/dev/null || true
  bb=$(find "$tmp" -maxdepth 3 -name busybox -type f ! -path "$tmp/root/*" | head -1)
  [ -n "$bb" ] || { log "busybox not found in $rootfs"; exit 1; }
  cp "$bb" "$tmp/root/bin/busybox"
  for a in $("$tmp/root/bin/busybox" --list); do
    [ "$a" = busybox ] || ln -s busybox "$tmp/root/bin/$a"
  done
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' >"$tmp/root/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$tmp/root/etc/group"
  tar --numeric-owner --owner=0 --group=0 -C "$tmp/root" -cf "$busybox_rootfs.tmp" .
  mv -f "$busybox_rootfs.tmp" "$busybox_rootfs"
fi

cd "$repo"
go run ./hack/oci -o "$out/agnhost.tar" -name "$AGNHOST_IMAGE" -base "$rootfs" \
  -add "$agnhost=/agnhost" -symlink /agnhost-2=agnhost -entrypoint /agnhost -cmd pause
go run ./hack/oci -o "$out/nginx.tar" -name "$NGINX_IMAGE" -base "$rootfs" \
  -add "$agnhost=/agnhost" -entrypoint /agnhost -cmd netexec -cmd --http-port=80
go run ./hack/oci -o "$out/busybox.tar" -name "$BUSYBOX_IMAGE" -base "$busybox_rootfs" -cmd sh
go run ./hack/oci -o "$out/regression-issue-74839.tar" -name "$REGRESSION_IMAGE" -base "$rootfs" \
  -add "$regression=/regression-issue-74839" -entrypoint /regression-issue-74839
go run ./hack/oci -o "$out/distroless-iptables.tar" -name "$IPTABLES_IMAGE" -base "$iptables_rootfs" -cmd /bin/sh
log "images in $out: $AGNHOST_IMAGE $BUSYBOX_IMAGE $NGINX_IMAGE $REGRESSION_IMAGE $IPTABLES_IMAGE"
