# common.sh: names and helpers shared by up.sh, down.sh and smoke.sh (sourced).
# shellcheck shell=bash

NS=${KPP_CLUSTER_NETNS:-kpp-cluster}        # the cluster's network namespace
STATE=${KPP_CLUSTER_DIR:-/var/lib/kpp-cluster}
NODE=kpp-node0                                # node name
NODE_IP=10.99.0.2                             # on the port-less bridge node0
NODE_CIDR=10.99.0.2/24
POD_CIDR=10.244.0.0/24
SERVICE_CIDR=10.96.0.0/12
DNS_IP=10.96.0.10
PAUSE_IMAGE=registry.k8s.io/pause:3.10.2
SERVE_IMAGE=kpp.invalid/serve:1
# make cluster NODES=3 runs kube-apiserver as a static pod of node 0, from this image of the binary.
APISERVER_IMAGE=registry.k8s.io/kube-apiserver:v1.36.3
# CoreDNS (hack/cluster/build.sh builds the version kubeadm v1.36 deploys), named as kubeadm does.
COREDNS_IMAGE=registry.k8s.io/coredns/coredns:v1.14.2
KUBECONFIG_ADMIN=$STATE/admin.kubeconfig
SOCK=$STATE/containerd/containerd.sock
# Paths outside $STATE that the components write to (fixed in their code): up.sh records which
# existed before, down.sh removes the others.
FIXED_PATHS="/var/lib/kubelet /var/log/containers /run/containerd /var/lib/cni"
# Global sysctls kubelet sets (protectKernelDefaults: false): saved by up.sh, restored by down.sh.
SYSCTLS="vm.overcommit_memory kernel.panic kernel.panic_on_oops"

# Multi-node (make cluster NODES=3): node 0 is the one above (control plane, namespace $NS, its
# files in $STATE); node I >= 1 is kpp-nodeI at 10.99.0.(2+I) in namespace $NS-nodeI, with its
# containerd, kubelet and the fixed paths under $STATE/nodeI, in a mount namespace of its own
# ($STATE/mnt/nodeI), and kubelet's cgroup root /kpp-nodeI. Every node has a UTS namespace whose
# hostname is its name ($STATE/mnt/uts-nodeI). The nodes' eth0 veths meet on bridge
# br0 in namespace $SWITCH_NS; pod CIDR 10.244.I.0/24, routed between the nodes. up.sh writes the
# node count to $STATE/nodes.
SWITCH_NS=$NS-switch
MAX_NODES=9
# node_count: the nodes of the running cluster (NODES before up.sh wrote it).
node_count() { cat "$STATE/nodes" 2>/dev/null || echo "${NODES:-1}"; }
node_name() { echo "kpp-node$1"; }
node_ip() { echo "10.99.0.$((2 + $1))"; }
node_pod_cidr() { echo "10.244.$1.0/24"; }
node_netns() { if [ "$1" = 0 ]; then echo "$NS"; else echo "$NS-node$1"; fi; }
node_dir() { if [ "$1" = 0 ]; then echo "$STATE"; else echo "$STATE/node$1"; fi; }
node_sock() { echo "$(node_dir "$1")/containerd/containerd.sock"; }
node_mntns() { echo "$STATE/mnt/node$1"; }
# Several nodes: each node's UTS namespace (hostname = node name), node 0's too.
node_utsns() { echo "$STATE/mnt/uts-node$1"; }
# node_exec I COMMAND...: runs COMMAND in node I's network namespace (and mount namespace).
node_exec() {
  local i=$1
  shift
  local args=(--net="/run/netns/$(node_netns "$i")")
  [ "$i" = 0 ] || args+=(--mount="$(node_mntns "$i")")
  [ ! -e "$(node_utsns "$i")" ] || args+=(--uts="$(node_utsns "$i")")
  nsenter "${args[@]}" "$@"
}

log() { printf 'cluster: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

# need_cluster TARGET: what make TARGET needs before it works on the running cluster - root, the
# cluster - and the control plane's binaries (KPP_APISERVER, KPP_KUBECTL, KPP_ETCD; kc runs the
# kubectl).
need_cluster() {
  [ "$(id -u)" = 0 ] || die "make $1 needs root"
  [ -e "/run/netns/$NS" ] || die "no cluster (make cluster first)"
  eval "$("$(dirname "${BASH_SOURCE[0]}")/../controlplane-build.sh")"
}
ns() { nsenter --net="/run/netns/$NS" "$@"; }
# kc runs kubectl as the cluster admin inside the cluster namespace.
kc() { ns "$KPP_KUBECTL" --kubeconfig="$KUBECONFIG_ADMIN" "$@"; }

# wait_for DESCRIPTION SECONDS COMMAND...: polls COMMAND every 0.5 s until it succeeds or the
# deadline passes.
wait_for() {
  local what=$1 secs=$2 deadline
  shift 2
  deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      log "timed out after ${secs}s waiting for $what"
      return 1
    fi
    sleep 0.5
  done
}

# serve_deployment prints the manifest of the two-pod serve Deployment (app: serve, HTTP on 8080,
# ready once it answers) the cluster steps put behind their Services; SERVE_IMAGE names the image.
serve_deployment() {
  cat <<YAML
apiVersion: apps/v1
kind: Deployment
metadata: {name: serve}
spec:
  replicas: 2
  selector: {matchLabels: {app: serve}}
  template:
    metadata: {labels: {app: serve}}
    spec:
      containers:
      - name: serve
        image: $SERVE_IMAGE
        imagePullPolicy: Never
        args: [-listen, ":8080"]
        ports: [{containerPort: 8080}]
        readinessProbe: {httpGet: {path: /, port: 8080}, periodSeconds: 1}
YAML
}
