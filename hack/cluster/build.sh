#!/usr/bin/env bash
# build.sh builds the node components of the real cluster (make cluster) from the Go module
# proxy, once, into the cache hack/controlplane-build.sh uses:
#
#   ${KPP_CACHE:-$HOME/.cache/kube-portal-proxy}/bin/kubelet-<kube version>
#   ${KPP_CACHE:-$HOME/.cache/kube-portal-proxy}/bin/kube-controller-manager-<kube version>
#   ${KPP_CACHE:-$HOME/.cache/kube-portal-proxy}/bin/kube-scheduler-<kube version>
#   ${KPP_CACHE:-$HOME/.cache/kube-portal-proxy}/bin/coredns-<coredns version>   (cluster DNS)
#
# The same way as controlplane-build.sh (build_kubernetes in hack/lib/kube-build.sh): a throwaway
# module that requires k8s.io/kubernetes and replaces every staging module by its published
# v0.<minor>.<patch>, then one `go build` of the three main packages (they share most of their packages, so one invocation compiles them once).
# A cold build takes ~8 minutes on 2 cores. It prints NAME=path lines (KPP_KUBELET,
# KPP_CONTROLLER_MANAGER, KPP_SCHEDULER, KPP_COREDNS).
#
# Environment: KPP_CACHE, KPP_KUBE_VERSION (default v1.36.3), KPP_KEEP_GOCACHE=1 keeps the
# private build cache, KPP_GOCACHE a
# build cache shared with the other builds of k8s.io/kubernetes (kept; see controlplane-build.sh).
set -euo pipefail
# The cache layout, log and die, the build environment; build_kubernetes and its steps.
# shellcheck source=hack/lib/kube-build.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib/kube-build.sh"
kube_build_init cluster-build

kube_version=${KPP_KUBE_VERSION:-v1.36.3}

kubelet=$bin_dir/kubelet-$kube_version
kcm=$bin_dir/kube-controller-manager-$kube_version
scheduler=$bin_dir/kube-scheduler-$kube_version
# CoreDNS: the version kubeadm v1.36 deploys (cmd/kubeadm/app/constants CoreDNSVersion).
coredns_version=${KPP_COREDNS_VERSION:-v1.14.2}
coredns=$bin_dir/coredns-$coredns_version

build_coredns() {
  local dir=$work_dir/coredns-$coredns_version
  log "building coredns $coredns_version (~3 min cold on 2 cores)"
  kube_module_new "$dir" kpp.invalid/cluster-build/coredns
  (cd "$dir" && go mod edit -require="github.com/coredns/coredns@$coredns_version" -tool=github.com/coredns/coredns && go mod tidy)
  kube_install "$dir" "-s -w" "$coredns" github.com/coredns/coredns
  rm -rf "$dir"
}

main() {
  build_cache_open .lock-node gocache-node
  if [ ! -x "$kubelet" ] || [ ! -x "$kcm" ] || [ ! -x "$scheduler" ] || [ ! -x "$coredns" ]; then
    command -v go >/dev/null 2>&1 || die "go not found in PATH (need Go >= 1.26)"
    if [ ! -x "$kubelet" ] || [ ! -x "$kcm" ] || [ ! -x "$scheduler" ]; then
      log "building kubelet, kube-controller-manager and kube-scheduler $kube_version (~8 min cold on 2 cores)"
      build_kubernetes cluster-build/node k8s.io/kubernetes/cmd/kubelet="$kubelet" \
        k8s.io/kubernetes/cmd/kube-controller-manager="$kcm" k8s.io/kubernetes/cmd/kube-scheduler="$scheduler"
    fi
    [ -x "$coredns" ] || build_coredns
    build_cache_close
  fi
  printf 'KPP_KUBELET=%s\nKPP_CONTROLLER_MANAGER=%s\nKPP_SCHEDULER=%s\nKPP_COREDNS=%s\n' "$kubelet" "$kcm" "$scheduler" "$coredns"
}

main "$@"
