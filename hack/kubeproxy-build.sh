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
# It builds the way hack/controlplane-build.sh builds kube-apiserver (build_kubernetes in
# hack/lib/kube-build.sh, which says why): a throwaway module that requires
# k8s.io/kubernetes@<version>, replaces every staging module by its published v0.<minor>.<patch>
# release and `tool`s cmd/kube-proxy. Nothing is patched.
#
# Environment:
#   KPP_CACHE          cache root (default $HOME/.cache/kube-portal-proxy)
#   KPP_KUBE_VERSION   k8s.io/kubernetes version (default v1.36.3, as controlplane-build.sh)
#   KPP_GOCACHE        a build cache shared with the other builds of k8s.io/kubernetes (kept): with
#                      the control plane's cache this build takes ~1-2 min instead of ~5
#   KPP_KEEP_GOCACHE   set to 1 to keep the private build cache (when KPP_GOCACHE is unset)
set -euo pipefail
# The cache layout, log and die, the build environment; build_kubernetes and its steps.
# shellcheck source=hack/lib/kube-build.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/kube-build.sh"
kube_build_init kubeproxy-build

kube_version=${KPP_KUBE_VERSION:-v1.36.3}
proxy=$bin_dir/kube-proxy-$kube_version

main() {
  build_cache_open .kubeproxy.lock gocache-kubeproxy
  if [ ! -x "$proxy" ]; then
    command -v go >/dev/null 2>&1 || die "go not found in PATH (need Go >= 1.26)"
    log "building kube-proxy $kube_version"
    build_kubernetes kubeproxy-build/kube-proxy k8s.io/kubernetes/cmd/kube-proxy="$proxy"
    build_cache_close
  fi
  printf 'KPP_KUBE_PROXY=%s\n' "$proxy"
}

main "$@"
