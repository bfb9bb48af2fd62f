#!/usr/bin/env bash
# kubeproxy-build.sh builds today's kube-proxy - the same Kubernetes release as the control plane
# (hack/controlplane-build.sh, v1.36.x), iptables and nftables modes in one binary - from the Go
# module proxy, once, into the version-keyed cache:
#
#   ${KPP_CACHE:-$HOME/.cache/kube-portal-proxy}/bin/kube-proxy-<kube version>
#
# bench/scale -cluster -kube-proxy <that path> runs it beside kube-portal-proxy against the same
# kube-apiserver. An existing binary is not rebuilt. It prints KPP_KUBE_PROXY=path, so
# `eval "$(hack/kubeproxy-build.sh)"` works.
#
# It builds the way hack/controlplane-build.sh builds kube-apiserver (see there for why): a
# throwaway module that requires k8s.io/kubernetes@<version>, replaces every staging module by its
# published v0.<minor>.<patch> release and `tool`s cmd/kube-proxy. Nothing is patched.
#
# Environment:
#   KPP_CACHE          cache root (default $HOME/.cache/kube-portal-proxy)
#   KPP_KUBE_VERSION   k8s.io/kubernetes version (default v1.36.3, as controlplane-build.sh)
#   KPP_GOCACHE        a build cache shared with the other builds of k8s.io/kubernetes (kept): with
#                      the control plane's cache this build takes ~1-2 min instead of ~5
#   KPP_KEEP_GOCACHE   set to 1 to keep the private build cache (when KPP_GOCACHE is unset)
set -euo pipefail

kube_version=${KPP_KUBE_VERSION:-v1.36.3}
cache=${KPP_CACHE:-${HOME:?HOME or KPP_CACHE must be set}/.cache/kube-portal-proxy}
bin_dir=$cache/bin
work_dir=$cache/build
proxy=$bin_dir/kube-proxy-$kube_version

log() { printf 'kubeproxy-build: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

export GOWORK=off GOFLAGS=-buildvcs=false GOTOOLCHAIN=local
unset GOOS GOARCH

# staging_replaces (k8s.io/kubernetes's ./staging replaces, paired with their releases).
# shellcheck source=hack/lib/staging.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/staging.sh"

build() {
  local dir=$work_dir/kube-proxy-$kube_version
  log "building kube-proxy $kube_version"
  rm -rf "$dir"
  mkdir -p "$dir"
  (cd "$dir" && go mod init kpp.invalid/kubeproxy-build/kube-proxy >/dev/null 2>&1)
  local edits=() mod ver count=0
  while read -r mod ver; do
    edits+=("-replace=$mod=$mod@$ver")
    count=$((count + 1))
  done < <(cd "$dir" && staging_replaces)
  log "replacing $count staging modules by their v0.${kube_version#v1.} releases"
  (
    cd "$dir"
    go mod edit "${edits[@]}" -require="k8s.io/kubernetes@$kube_version" -tool=k8s.io/kubernetes/cmd/kube-proxy
    go mod tidy
    local minor=${kube_version#v1.}
    minor=${minor%%.*}
    local ldflags="-s -w" pkg
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      ldflags+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
      ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
    done
    CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$proxy.tmp" k8s.io/kubernetes/cmd/kube-proxy
    mv -f "$proxy.tmp" "$proxy"
  )
  rm -rf "$dir"
}

main() {
  mkdir -p "$bin_dir" "$work_dir"
  exec 9>"$work_dir/.kubeproxy.lock"
  if command -v flock >/dev/null 2>&1; then
    flock 9
  fi
  if [ ! -x "$proxy" ]; then
    command -v go >/dev/null 2>&1 || die "go not found in PATH (need Go >= 1.26)"
    export GOCACHE=${KPP_GOCACHE:-$work_dir/gocache-kubeproxy}
    build
    if [ "${KPP_KEEP_GOCACHE:-}" != 1 ] && [ -z "${KPP_GOCACHE:-}" ]; then
      go clean -cache >/dev/null 2>&1 || true
      rm -rf "$GOCACHE"
    fi
  fi
  printf 'KPP_KUBE_PROXY=%s\n' "$proxy"
}

main "$@"
