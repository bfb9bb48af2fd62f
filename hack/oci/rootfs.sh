#!/usr/bin/env bash
# rootfs.sh OUT.tar writes the root filesystem of the kube-portal-proxy image as a tar, without a
# container engine: mmdebstrap (a Debian package) installs Debian bookworm's minbase (the
# essential packages plus apt: what debian:bookworm-slim holds) and the packages the Dockerfile's
# runtime stage installs, then selects the same iptables alternatives. dockerfile_test.go checks
# that the PACKAGES and ALTERNATIVES below are the Dockerfile's.
#
# Needs root (or mmdebstrap's unshare mode) and the Debian mirror (deb.debian.org, or
# KPP_DEBIAN_MIRROR); the result is cached by the caller (make image-oci).
set -euo pipefail

out=${1:?usage: rootfs.sh OUT.tar}
mirror=${KPP_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${KPP_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

PACKAGES="iptables nftables"
ALTERNATIVES="iptables=/usr/sbin/iptables-nft ip6tables=/usr/sbin/ip6tables-nft"

command -v mmdebstrap >/dev/null 2>&1 || {
  echo "rootfs.sh: mmdebstrap not found (apt-get install mmdebstrap)" >&2
  exit 1
}

hooks=()
for a in $ALTERNATIVES; do
  hooks+=(--customize-hook="chroot \"\$1\" update-alternatives --set ${a%%=*} ${a#*=}")
done

# As debian:*-slim: no documentation, manual pages or translations.
mmdebstrap --variant=minbase --mode=root --format=tar \
  --include="${PACKAGES// /,}" \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  "${hooks[@]}" \
  bookworm "$out.tmp" \
  "deb $mirror bookworm main" \
  "deb $mirror bookworm-updates main" \
  "deb $security bookworm-security main"
mv -f "$out.tmp" "$out"
