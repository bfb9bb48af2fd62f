#!/usr/bin/env bash
# test.sh proves make cluster end to end (make cluster-test, root, not part of make test): it
# fingerprints the root network namespace and the host state the cluster touches, runs
# make cluster, make cluster-smoke and make cluster-down, and fails if anything differs
# afterwards: iptables (nft and legacy) and the nft ruleset, links, addresses and routes of the
# root namespace, ip_forward and the sysctls kubelet sets, the fixed paths, kubepods cgroups,
# the cluster's namespace, mounts and processes.
#
# KPP_CLUSTER_TEST_STEPS: the make targets run on the cluster between make cluster and
# make cluster-down (default cluster-smoke); NODES (make cluster-test NODES=3) the cluster's
# node count. CI runs
# "cluster-smoke cluster-rollout cluster-swap conformance-ci": the cluster is removed and the host compared
# even when a step fails.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source=common.sh
. "$here/common.sh"
[ "$(id -u)" = 0 ] || die "make cluster-test needs root"

fingerprint() {
  echo "## iptables-nft"; iptables-nft-save 2>/dev/null | grep -v '^#' || true
  echo "## ip6tables-nft"; ip6tables-nft-save 2>/dev/null | grep -v '^#' || true
  echo "## iptables-legacy"; iptables-legacy-save 2>/dev/null | grep -v '^#' || true
  echo "## nft"; nft list ruleset 2>/dev/null || true
  echo "## links"; ip -o link show | awk '{print $2, $3}'
  echo "## addresses"; ip -o addr show | awk '{print $2, $4}'
  echo "## routes"; ip route show table all
  echo "## sysctls"; sysctl net.ipv4.ip_forward $SYSCTLS
  echo "## paths"; for p in $FIXED_PATHS "$STATE" /run/netns/"$NS"*; do [ -e "$p" ] && echo "$p"; done || true
  echo "## cgroups"; ls -d /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/*/kpp-node* 2>/dev/null || true
  echo "## mounts"; grep -F "$STATE" /proc/self/mountinfo || true
  echo "## processes"; for p in /proc/[0-9]*; do
    tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -qF "$STATE" && echo "${p#/proc/}: $(tr '\0' ' ' <"$p/cmdline")"
  done || true
}

before=$(fingerprint)
rc=0
make -C "$repo" cluster || rc=$?
started=$SECONDS
if [ $rc = 0 ]; then
  for step in ${KPP_CLUSTER_TEST_STEPS:-cluster-smoke}; do
    t0=$SECONDS
    make -C "$repo" "$step" || { rc=$?; log "FAIL: make $step"; }
    log "make $step: $((SECONDS - t0))s"
  done
fi
log "cluster up and steps: $((SECONDS - started))s"
make -C "$repo" cluster-down || rc=$?
after=$(fingerprint)
if ! diff -u <(echo "$before") <(echo "$after") >&2; then
  log "FAIL: the host differs after make cluster-down (above: - before, + after)"
  exit 1
fi
log "host state after cluster-down identical to before (root namespace rules, links, routes, sysctls, paths, cgroups, mounts, processes)"
[ $rc = 0 ] || { log "FAIL: make cluster or a step (${KPP_CLUSTER_TEST_STEPS:-cluster-smoke}) failed"; exit 1; }
log "PASS"
