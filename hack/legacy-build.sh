#!/usr/bin/env bash
# legacy-build.sh builds the real legacy userspace kube-proxy - Kubernetes v1.25.x, the last
# release with --proxy-mode=userspace - from the Go module proxy, once, into the version-keyed cache:
#
#   ${KPP_CACHE:-$HOME/.cache/kube-portal-proxy}/bin/kube-proxy-<kube version>
#
# The bench suite (bench/suite, target "legacy") runs it beside kube-portal-proxy. An existing
# binary is not rebuilt. It prints KPP_LEGACY_PROXY=path, so `eval "$(hack/legacy-build.sh)"` works.
#
# It builds the way hack/controlplane-build.sh builds kube-apiserver (the steps of
# hack/lib/kube-build.sh): a throwaway module that
# requires k8s.io/kubernetes@<version> and replaces every staging module by its published
# v0.<minor>.<patch> release. Go 1.26 is tried first (KPP_LEGACY_TOOLCHAIN=local); a Kubernetes
# release this old may need the toolchain of its day, which the module proxy serves as
# golang.org/toolchain (set KPP_LEGACY_TOOLCHAIN=go1.20.14, say).
#
# One file is patched (in the wrapper's vendor/ tree), nothing else: pkg/proxy/userspace/rlimit.go.
# The userspace proxier sets RLIMIT_NOFILE to 64000 (soft and hard) and refuses to start when it
# may not - as in a container without CAP_SYS_RESOURCE whose hard limit is lower. The patch
# tries exactly that first and, only when refused, raises the soft limit to the hard one instead.
#
# Environment:
#   KPP_CACHE               cache root (default $HOME/.cache/kube-portal-proxy)
#   KPP_LEGACY_VERSION      k8s.io/kubernetes version (default v1.25.16, the last v1.25 patch)
#   KPP_LEGACY_TOOLCHAIN    GOTOOLCHAIN for the build (default local)
#   KPP_KEEP_GOCACHE        set to 1 to keep the private build cache
#
# Cost here (2 shared cores): 2-5 minutes with a cold build cache, ~40 MB binary. The module proxy
# does not serve every staging module at v0.25.16; those come at the newest served patch (logged).
set -euo pipefail
# The cache layout, log and die, the build environment; build_kubernetes and its steps.
# shellcheck source=hack/lib/kube-build.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/kube-build.sh"

kube_version=${KPP_LEGACY_VERSION:-v1.25.16}
toolchain=${KPP_LEGACY_TOOLCHAIN:-local}
kube_build_init legacy-build "$toolchain"
proxy=$bin_dir/kube-proxy-$kube_version

# Its own build cache, never the one KPP_GOCACHE shares: an old toolchain's objects serve no other build.
unset KPP_GOCACHE

# served_patch prints the newest patch release of module $1 at or below version $2 whose source the
# module proxy serves (and the checksum database vouches for). proxy.golang.org answers "403 not available" for the zips of a few staging
# modules of v1.25.16 (k8s.io/kube-proxy among them, whose config types kube-proxy imports), while
# serving their v0.25.15; a staging module's API does not change between patch releases.
served_patch() {
  local mod=$1 ver=$2 base patch
  base=${ver%.*}
  patch=${ver##*.}
  while (( patch >= 0 )); do
    if go mod download "$mod@$base.$patch" >/dev/null 2>&1; then
      printf '%s\n' "$base.$patch"
      return
    fi
    patch=$((patch - 1))
  done
  # None: keep the release's own version. Its go.mod still loads the module graph, and only a
  # module whose packages kube-proxy imports needs its source (the build then says which).
  printf '%s\n' "$ver"
}

# patch_rlimit replaces the vendored pkg/proxy/userspace/rlimit.go at $1 (see the header).
patch_rlimit() {
  grep -q 'Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Max: limit, Cur: limit})' "$1" ||
    die "$1 is not the rlimit.go this patch expects"
  cat >"$1" <<'GO'
//go:build !windows

package userspace

import (
	"errors"

	"golang.org/x/sys/unix"
)

// setRLimit is upstream's (soft and hard limit to limit); when the process may not raise its
// hard limit (EPERM: no CAP_SYS_RESOURCE), it raises the soft limit to the hard one instead.
func setRLimit(limit uint64) error {
	err := unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Max: limit, Cur: limit})
	if !errors.Is(err, unix.EPERM) {
		return err
	}
	var cur unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &cur); err != nil {
		return err
	}
	// No min(): the package builds at kubernetes' language version, go 1.19.
	cur.Cur = cur.Max
	if limit < cur.Max {
		cur.Cur = limit
	}
	return unix.Setrlimit(unix.RLIMIT_NOFILE, &cur)
}
GO
}

# build is build_kubernetes's sequence with two differences: a blank import where older go
# commands have no -tool edit, and a vendor tree to patch before the build.
build() {
  local dir=$work_dir/kube-proxy-$kube_version
  log "building kube-proxy $kube_version with GOTOOLCHAIN=$toolchain"
  kube_module_new "$dir" kpp.invalid/legacy-build/kube-proxy
  # A blank import pins the main package's dependencies.
  printf '//go:build tools\n\npackage tools\n\nimport _ "k8s.io/kubernetes/cmd/kube-proxy"\n' >"$dir/tools.go"
  kube_module_require --pin served_patch "$dir"
  (cd "$dir" && go mod vendor)
  patch_rlimit "$dir/vendor/k8s.io/kubernetes/pkg/proxy/userspace/rlimit.go"
  kube_install "$dir" "$(kube_ldflags)" "$proxy" k8s.io/kubernetes/cmd/kube-proxy -mod=vendor
  rm -rf "$dir"
}

main() {
  build_cache_open .legacy.lock gocache-legacy
  if [ ! -x "$proxy" ]; then
    command -v go >/dev/null 2>&1 || die "go not found in PATH"
    build
    build_cache_close
  fi
  printf 'KPP_LEGACY_PROXY=%s\n' "$proxy"
}

main "$@"
