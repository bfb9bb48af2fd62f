#!/usr/bin/env bash
# build.sh builds the node components of the real cluster (make cluster) from the Go module
# proxy, once, into the cache hack/controlplane-build.sh uses:
#
#   ${KPP_CACHE:-$HOME/.cache/kube-portal-proxy}/bin/kubelet-<kube version>
#   ${KPP_CACHE:-$HOME/.cache/kube-portal-proxy}/bin/kube-controller-manager-<kube version>
#   ${KPP_CACHE:-$HOME/.cache/kube-portal-proxy}/bin/kube-scheduler-<kube version>
#   ${KPP_CACHE:-$HOME/.cache/kube-portal-proxy}/bin/coredns-<coredns version>   (cluster DNS)
#
# The same way as controlplane-build.sh: a throwaway module that requires k8s.io/kubernetes and
# replaces every staging module by its published v0.<minor>.<patch>, then one `go build` of the
# three main packages (they share most of their packages, so one invocation compiles them once).
# A cold build takes ~8 minutes on 2 cores. It prints NAME=path lines (KPP_KUBELET,
# KPP_CONTROLLER_MANAGER, KPP_SCHEDULER, KPP_COREDNS).
#
# Environment: KPP_CACHE, KPP_KUBE_VERSION (default v1.36.3), KPP_KEEP_GOCACHE=1 keeps the
# private build cache, KPP_GOCACHE a
# build cache shared with the other builds of k8s.io/kubernetes (kept; see controlplane-build.sh).
set -euo pipefail

kube_version=${KPP_KUBE_VERSION:-v1.36.3}
cache=${KPP_CACHE:-${HOME:?HOME or KPP_CACHE must be set}/.cache/kube-portal-proxy}
bin_dir=$cache/bin
work_dir=$cache/build

kubelet=$bin_dir/kubelet-$kube_version
kcm=$bin_dir/kube-controller-manager-$kube_version
scheduler=$bin_dir/kube-scheduler-$kube_version
# CoreDNS: the version kubeadm v1.36 deploys (cmd/kubeadm/app/constants CoreDNSVersion).
coredns_version=${KPP_COREDNS_VERSION:-v1.14.2}
coredns=$bin_dir/coredns-$coredns_version

log() { printf 'cluster-build: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

export GOWORK=off GOFLAGS=-buildvcs=false GOTOOLCHAIN=local
unset GOOS GOARCH

# staging_replaces (k8s.io/kubernetes's ./staging replaces, paired with their releases).
# shellcheck source=hack/lib/staging.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib/staging.sh"

build_node() {
  local dir=$work_dir/node-$kube_version
  log "building kubelet, kube-controller-manager and kube-scheduler $kube_version (~8 min cold on 2 cores)"
  rm -rf "$dir"
  mkdir -p "$dir"
  (cd "$dir" && go mod init kpp.invalid/cluster-build/node >/dev/null 2>&1)
  local edits=() mod ver
  while read -r mod ver; do
    edits+=("-replace=$mod=$mod@$ver")
  done < <(cd "$dir" && staging_replaces)
  (
    cd "$dir"
    go mod edit "${edits[@]}" \
      -require="k8s.io/kubernetes@$kube_version" \
      -tool=k8s.io/kubernetes/cmd/kubelet \
      -tool=k8s.io/kubernetes/cmd/kube-controller-manager \
      -tool=k8s.io/kubernetes/cmd/kube-scheduler
    go mod tidy
    local minor=${kube_version#v1.}
    minor=${minor%%.*}
    local ldflags="-s -w" pkg
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      ldflags+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
      ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
    done
    mkdir -p out
    CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o out/ \
      k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler
    mv -f out/kubelet "$kubelet"
    mv -f out/kube-controller-manager "$kcm"
    mv -f out/kube-scheduler "$scheduler"
  )
  rm -rf "$dir"
}

build_coredns() {
  local dir=$work_dir/coredns-$coredns_version
  log "building coredns $coredns_version (~3 min cold on 2 cores)"
  rm -rf "$dir"
  mkdir -p "$dir"
  (
    cd "$dir"
    go mod init kpp.invalid/cluster-build/coredns >/dev/null 2>&1
    go mod edit -require="github.com/coredns/coredns@$coredns_version" -tool=github.com/coredns/coredns
    go mod tidy
    CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$coredns.tmp" github.com/coredns/coredns
    mv -f "$coredns.tmp" "$coredns"
  )
  rm -rf "$dir"
}

main() {
  mkdir -p "$bin_dir" "$work_dir"
  exec 9>"$work_dir/.lock-node"
  if command -v flock >/dev/null 2>&1; then flock 9; fi
  if [ ! -x "$kubelet" ] || [ ! -x "$kcm" ] || [ ! -x "$scheduler" ] || [ ! -x "$coredns" ]; then
    command -v go >/dev/null 2>&1 || die "go not found in PATH (need Go >= 1.26)"
    export GOCACHE=${KPP_GOCACHE:-$work_dir/gocache-node}
    { [ -x "$kubelet" ] && [ -x "$kcm" ] && [ -x "$scheduler" ]; } || build_node
    [ -x "$coredns" ] || build_coredns
    if [ "${KPP_KEEP_GOCACHE:-}" != 1 ] && [ -z "${KPP_GOCACHE:-}" ]; then
      go clean -cache >/dev/null 2>&1 || true
      rm -rf "$GOCACHE"
    fi
  fi
  printf 'KPP_KUBELET=%s\nKPP_CONTROLLER_MANAGER=%s\nKPP_SCHEDULER=%s\nKPP_COREDNS=%s\n' "$kubelet" "$kcm" "$scheduler" "$coredns"
}

main "$@"
