#!/usr/bin/env bash
# down.sh removes what up.sh started and changed (make cluster-down), on every node: the
# containers, every process by the PID up.sh recorded (and the containerd shims, found by the
# socket they serve), the mounts under the cluster's directory (among them the nodes' mount
# namespaces), the kubepods cgroups and nodes' cgroup roots, the network namespaces, the
# files kubelet and containerd write at fixed paths, and it restores the sysctls kubelet changed.
# Safe to run on a half-started cluster and twice.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=common.sh
. "$here/common.sh"

[ "$(id -u)" = 0 ] || die "make cluster-down needs root"

# stop NAME: SIGTERM the recorded PID, SIGKILL after 15 s.
stop() {
  local f=$STATE/pids/$1 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    wait_for "$1 (pid $pid) to exit" 15 sh -c "! kill -0 $pid" || kill -KILL "$pid" 2>/dev/null
    wait_for "$1 (pid $pid) to die" 5 sh -c "! kill -0 $pid"
    log "stopped $1 (pid $pid)"
  fi
  rm -f "$f"
}

# Every node (make cluster NODES=N): node 0 names its processes kubelet and containerd, node I
# kubelet-nodeI and containerd-nodeI (up.sh).
nodes=$(node_count)
suffix() { [ "$1" = 0 ] || echo "-node$1"; }
# The kubelets first, so they restart nothing; then the containers through containerd.
for ((i = 0; i < nodes; i++)); do stop "kubelet$(suffix "$i")"; done
for ((i = 0; i < nodes; i++)); do
  sock=$(node_sock "$i")
  if [ -S "$sock" ]; then
    for t in $(ctr -a "$sock" -n k8s.io tasks ls -q 2>/dev/null); do
      ctr -a "$sock" -n k8s.io tasks kill -s SIGKILL "$t" >/dev/null 2>&1
    done
    for t in $(ctr -a "$sock" -n k8s.io tasks ls -q 2>/dev/null); do
      wait_for "task $t to stop" 10 sh -c "ctr -a '$sock' -n k8s.io tasks ls | grep -q '^$t .*STOPPED'"
      ctr -a "$sock" -n k8s.io tasks delete "$t" >/dev/null 2>&1
    done
    for ctn in $(ctr -a "$sock" -n k8s.io containers ls -q 2>/dev/null); do
      ctr -a "$sock" -n k8s.io containers delete "$ctn" >/dev/null 2>&1
    done
  fi
  stop "containerd$(suffix "$i")"
  # Shims outlive containerd; each was started with "-address <its socket>".
  for p in /proc/[0-9]*; do
    if tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -q -- "-address $sock"; then
      pid=${p#/proc/}
      kill -KILL "$pid" 2>/dev/null && log "killed containerd shim pid $pid"
    fi
  done
done
stop kube-scheduler
stop kube-controller-manager
stop kube-apiserver
stop etcd

# Mounts under the cluster's directory (volumes, netns files, snapshots), deepest first.
if [ -d "$STATE" ]; then
  awk -v s="$STATE/" 'index($5, s) == 1 { print $5 }' /proc/self/mountinfo | sort -r | while read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m" && log "unmounted $m"
  done
fi

# kubepods cgroups, in every hierarchy, deepest first (only if up.sh found none there before).
if [ -f "$STATE/preexisting-cgroups" ] && [ ! -s "$STATE/preexisting-cgroups" ]; then
  for h in /sys/fs/cgroup/*/kubepods; do
    [ -d "$h" ] || continue
    find "$h" -depth -type d -exec rmdir {} \; 2>/dev/null
    [ -d "$h" ] && log "could not remove $h (processes left in it?)" || log "removed $h"
  done
fi

# The other nodes' cgroup roots (/kpp-nodeI), which up.sh created and listed.
if [ -f "$STATE/created-cgroups" ]; then
  while read -r h; do
    [ -d "$h" ] || continue
    find "$h" -depth -type d -exec rmdir {} \; 2>/dev/null
    [ -d "$h" ] && log "could not remove $h (processes left in it?)" || log "removed $h"
  done <"$STATE/created-cgroups"
fi

ip netns del "$NS" 2>/dev/null && log "deleted network namespace $NS"
# Every node's, also of a cluster whose up.sh stopped before it wrote $STATE/nodes.
for n in /run/netns/"$NS"-node[1-9]; do
  [ -e "$n" ] || continue
  ip netns del "${n#/run/netns/}" 2>/dev/null && log "deleted network namespace ${n#/run/netns/}"
done
ip netns del "$SWITCH_NS" 2>/dev/null && log "deleted network namespace $SWITCH_NS"

if [ -f "$STATE/sysctls" ]; then
  while IFS== read -r k v; do
    [ "$(sysctl -n "$k")" = "$v" ] || { sysctl -q -w "$k=$v" && log "restored $k=$v"; }
  done <"$STATE/sysctls"
fi

if [ -f "$STATE/preexisting" ]; then
  for p in $FIXED_PATHS; do
    if ! grep -qx "$p" "$STATE/preexisting" && [ -e "$p" ]; then
      rm -rf "$p" && log "removed $p"
    fi
  done
  # In directories that existed before, only what this cluster wrote.
  grep -qx /var/lib/kubelet "$STATE/preexisting" && rm -f /var/lib/kubelet/device-plugins/kubelet.sock
  if grep -qx /var/log/containers "$STATE/preexisting"; then
    find /var/log/containers -maxdepth 1 -type l -lname "$STATE/*" -delete
  fi
fi

rm -rf "$STATE" && log "removed $STATE"
