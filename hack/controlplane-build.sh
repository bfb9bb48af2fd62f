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
# every staging module (k8s.io/api, k8s.io/apimachinery, ...) by its published v0.<minor>.<patch>:
# build_kubernetes in hack/lib/kube-build.sh, which the other builds of Kubernetes share.
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
# The cache layout, log and die, the build environment; build_kubernetes and its steps.
# shellcheck source=hack/lib/kube-build.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/kube-build.sh"
kube_build_init controlplane-build

kube_version=${KPP_KUBE_VERSION:-v1.36.3}
etcd_version=${KPP_ETCD_VERSION:-v3.6.16}

apiserver=$bin_dir/kube-apiserver-$kube_version
kubectl=$bin_dir/kubectl-$kube_version
etcd=$bin_dir/etcd-$etcd_version

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

build_etcd() {
  local dir=$work_dir/etcd-$etcd_version
  log "building etcd $etcd_version (a cold build takes ~1.5 min on 2 cores)"
  kube_module_new "$dir" kpp.invalid/controlplane-build/etcd
  (cd "$dir" && go mod edit -require="go.etcd.io/etcd/server/v3@$etcd_version" -tool=go.etcd.io/etcd/server/v3 && go mod tidy)
  kube_install "$dir" "-s -w" "$etcd" go.etcd.io/etcd/server/v3
  rm -rf "$dir"
}

main() {
  build_cache_open .lock gocache
  if [ ! -x "$apiserver" ] || [ ! -x "$kubectl" ] || [ ! -x "$etcd" ]; then
    check_go
    [ -x "$etcd" ] || build_etcd
    if [ ! -x "$apiserver" ] || [ ! -x "$kubectl" ]; then
      log "building kube-apiserver and kubectl $kube_version (a cold build takes ~7 min on 2 cores)"
      build_kubernetes controlplane-build/kubernetes \
        k8s.io/kubernetes/cmd/kube-apiserver="$apiserver" k8s.io/kubernetes/cmd/kubectl="$kubectl"
    fi
    build_cache_close
  fi

  printf 'KPP_APISERVER=%s\nKPP_KUBECTL=%s\nKPP_ETCD=%s\n' "$apiserver" "$kubectl" "$etcd"
}

main "$@"
