#!/usr/bin/env bash
# controlplane-build.sh builds the control plane the end-to-end tests run against - kube-apiserver,
# a matching kubectl and etcd - from the Go module proxy, once, into a cache keyed by version:
#
#   ${KPP_CACHE:-$HOME/.cache/kube-portal-proxy}/bin/kube-apiserver-<kube version>
#   ${KPP_CACHE:-$HOME/.cache/kube-portal-proxy}/bin/kubectl-<kube version>
#   ${KPP_CACHE:-$HOME/.cache/kube-portal-proxy}/bin/etcd-<etcd version>
#
# Binaries that already exist are not rebuilt. It prints the three paths, one per line, as
# NAME=path (KPP_APISERVER, KPP_KUBECTL, KPP_ETCD), so `eval "$(hack/controlplane-build.sh)"` works.
#
# Why a throwaway module: `go install pkg@version` refuses both projects (their go.mod files carry
# replace directives), and importing k8s.io/kubernetes into this project's go.mod would drag in its
# 33 staging replaces and link a 100 MB server into test binaries. So each binary is built from a
# tiny module under the cache dir that `tool`s the main package and, for k8s.io/kubernetes, replaces
# every staging module (k8s.io/api, k8s.io/apimachinery, ...) by its published v0.<minor>.<patch>.
#
# Needs only Go (>= 1.26 for kube-apiserver v1.36) and network access to the module proxy; a cold
# build of everything takes ~8 minutes on 2 cores, ~2 GB RAM and ~700 MB of module downloads. The
# build cache (GOCACHE, several GB) is a private directory deleted afterwards; GOMODCACHE is shared.
#
# Environment:
#   KPP_CACHE          cache root (default $HOME/.cache/kube-portal-proxy)
#   KPP_KUBE_VERSION   k8s.io/kubernetes version (default v1.36.3)
#   KPP_ETCD_VERSION   go.etcd.io/etcd/server/v3 version (default v3.6.16)
#   KPP_KEEP_GOCACHE   set to 1 to keep the private build cache (faster rebuilds of other versions)
#   KPP_GOCACHE        a build cache shared with hack/cluster/build.sh and hack/conformance/build.sh
#                      (kept; .ci/run uses one so that the three cold builds compile k8s.io once)
set -euo pipefail

kube_version=${KPP_KUBE_VERSION:-v1.36.3}
etcd_version=${KPP_ETCD_VERSION:-v3.6.16}
cache=${KPP_CACHE:-${HOME:?HOME or KPP_CACHE must be set}/.cache/kube-portal-proxy}
bin_dir=$cache/bin
work_dir=$cache/build

apiserver=$bin_dir/kube-apiserver-$kube_version
kubectl=$bin_dir/kubectl-$kube_version
etcd=$bin_dir/etcd-$etcd_version

log() { printf 'controlplane-build: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

# The build must not be influenced by the caller's module setup (a go.work, -mod=vendor, ...), and
# must fail clearly rather than download a toolchain behind the user's back.
export GOWORK=off GOFLAGS=-buildvcs=false GOTOOLCHAIN=local
unset GOOS GOARCH

check_go() {
  command -v go >/dev/null 2>&1 || die "go not found in PATH (need Go >= 1.26)"
  local v
  v=$(go env GOVERSION)            # e.g. go1.26.8
  v=${v#go}
  local major=${v%%.*} rest=${v#*.}
  local minor=${rest%%.*}
  if (( major < 1 || (major == 1 && minor < 26) )); then
    die "Go $v is too old: kube-apiserver $kube_version needs Go >= 1.26"
  fi
}

# staging_replaces (k8s.io/kubernetes's ./staging replaces, paired with their releases).
# shellcheck source=hack/lib/staging.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/staging.sh"

# new_module creates a fresh throwaway module in $1 named $2.
new_module() {
  rm -rf "$1"
  mkdir -p "$1"
  (cd "$1" && go mod init "$2" >/dev/null 2>&1)
}

build_kubernetes() {
  local dir=$work_dir/kubernetes-$kube_version
  log "building kube-apiserver and kubectl $kube_version (a cold build takes ~7 min on 2 cores)"
  new_module "$dir" kpp.invalid/controlplane-build/kubernetes
  local edits=() mod ver count=0
  while read -r mod ver; do
    edits+=("-replace=$mod=$mod@$ver")
    count=$((count + 1))
  done < <(cd "$dir" && staging_replaces)
  log "replacing $count staging modules by their v0.${kube_version#v1.} releases"
  (
    cd "$dir"
    go mod edit "${edits[@]}" \
      -require="k8s.io/kubernetes@$kube_version" \
      -tool=k8s.io/kubernetes/cmd/kube-apiserver \
      -tool=k8s.io/kubernetes/cmd/kubectl
    go mod tidy
    local minor=${kube_version#v1.}
    minor=${minor%%.*}
    local ldflags="-s -w"
    local pkg
    # kubectl reports its client version from client-go, the server from component-base.
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      ldflags+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
      ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
    done
    CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$apiserver.tmp" k8s.io/kubernetes/cmd/kube-apiserver
    mv -f "$apiserver.tmp" "$apiserver"
    CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$kubectl.tmp" k8s.io/kubernetes/cmd/kubectl
    mv -f "$kubectl.tmp" "$kubectl"
  )
  rm -rf "$dir"
}

build_etcd() {
  local dir=$work_dir/etcd-$etcd_version
  log "building etcd $etcd_version (a cold build takes ~1.5 min on 2 cores)"
  new_module "$dir" kpp.invalid/controlplane-build/etcd
  (
    cd "$dir"
    go mod edit -require="go.etcd.io/etcd/server/v3@$etcd_version" -tool=go.etcd.io/etcd/server/v3
    go mod tidy
    CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$etcd.tmp" go.etcd.io/etcd/server/v3
    mv -f "$etcd.tmp" "$etcd"
  )
  rm -rf "$dir"
}

main() {
  mkdir -p "$bin_dir" "$work_dir"
  # Two concurrent runs (two test jobs on one machine) would race on the same throwaway modules.
  exec 9>"$work_dir/.lock"
  if command -v flock >/dev/null 2>&1; then
    flock 9
  fi

  if [ ! -x "$apiserver" ] || [ ! -x "$kubectl" ] || [ ! -x "$etcd" ]; then
    check_go
    # A private build cache: the k8s build leaves ~2.5 GB in it, which nothing else reuses.
    export GOCACHE=${KPP_GOCACHE:-$work_dir/gocache}
    [ -x "$etcd" ] || build_etcd
    { [ -x "$apiserver" ] && [ -x "$kubectl" ]; } || build_kubernetes
    if [ "${KPP_KEEP_GOCACHE:-}" != 1 ] && [ -z "${KPP_GOCACHE:-}" ]; then
      go clean -cache >/dev/null 2>&1 || true
      rm -rf "$GOCACHE"
    fi
  fi

  printf 'KPP_APISERVER=%s\nKPP_KUBECTL=%s\nKPP_ETCD=%s\n' "$apiserver" "$kubectl" "$etcd"
}

main "$@"
