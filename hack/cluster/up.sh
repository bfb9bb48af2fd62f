#!/usr/bin/env bash
# up.sh starts a single-node Kubernetes cluster entirely inside a network namespace of its own
# (make cluster; see docs/cluster.md): etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, containerd (Debian's) and kubelet, then installs kube-portal-proxy the way a
# user does: its OCI image imported into containerd and `kubectl apply -k` of deploy/ through an
# overlay that changes the image and points the proxy at the API server directly (or, with
# KPP_INSTALL=helm, `helm install` of the chart with those values).
#
# The namespace has lo and a port-less bridge node0 carrying the node IP, a route for the
# service range on it and no default route: nothing leaves it. Global side effects (sysctls
# kubelet sets, cgroup directories, fixed paths) are recorded under $STATE and undone by
# down.sh, which also stops every process by the PID recorded here.
#
# NODES=N (make cluster NODES=3) starts N nodes instead (common.sh names them): each a network
# namespace with its own containerd and kubelet (own root, state, socket, log and CNI
# directories, own mount namespace for the paths kubelet and containerd fix, own cgroup root),
# their eth0 veths on bridge br0 in a switch namespace of our own, a pod CIDR per node
# (10.244.I.0/24, bridge CNI + host-local) and a route per other node's pod CIDR via that node,
# as kind's kindnet sets them up. The control plane runs on node 0 (namespace $NS, 10.99.0.2); the
# kube-portal-proxy DaemonSet on every node. Nothing links any of these namespaces to the root one.
#
# Environment: IMAGE, IMAGE_OCI (the kube-portal-proxy image and its tarball, from make),
# NODES (default 1), KPP_CLUSTER_DIR (default /var/lib/kpp-cluster), KPP_CLUSTER_NETNS (default
# kpp-cluster).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source=common.sh
. "$here/common.sh"

[ "$(id -u)" = 0 ] || die "make cluster needs root (network namespace, containerd, kubelet)"
: "${IMAGE:?IMAGE (the kube-portal-proxy image name) must be set; run make cluster}"
: "${IMAGE_OCI:?IMAGE_OCI (the image tarball) must be set; run make cluster}"
for tool in ip nsenter setsid containerd containerd-shim-runc-v2 ctr runc iptables openssl go; do
  command -v "$tool" >/dev/null 2>&1 ||
    die "$tool not found: apt-get install iproute2 util-linux containerd runc containernetworking-plugins iptables openssl"
done
[ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] && [ -x /usr/lib/cni/loopback ] && [ -x /usr/lib/cni/portmap ] ||
  die "CNI plugins not found in /usr/lib/cni: apt-get install containernetworking-plugins"
[ -e "/run/netns/$NS" ] && die "network namespace $NS exists: the cluster is up (make cluster-down first)"
[ -e "$STATE" ] && die "$STATE exists: the cluster is up or was not removed (make cluster-down)"
nodes=${NODES:-1}
[[ $nodes =~ ^[1-9]$ ]] && ((nodes <= MAX_NODES)) || die "NODES=$nodes: want 1 to $MAX_NODES"
if ((nodes > 1)); then
  command -v unshare >/dev/null 2>&1 || die "unshare not found: apt-get install util-linux"
  for ((i = 0; i < nodes; i++)); do
    [ -e "/run/netns/$(node_netns "$i")" ] && die "network namespace $(node_netns "$i") exists (make cluster-down first)"
  done
  [ -e "/run/netns/$SWITCH_NS" ] && die "network namespace $SWITCH_NS exists (make cluster-down first)"
fi

started=$SECONDS
eval "$("$repo/hack/controlplane-build.sh")"
eval "$("$here/build.sh")"

mkdir -p "$STATE"/{pids,logs,pki,images,bin,etcd,kubelet/pki,pod-logs,cni/net.d,cni/networks,cni/cache,containerd,overlay,manifests}
for ((i = 1; i < nodes; i++)); do
  mkdir -p "$(node_dir "$i")"/{kubelet/pki,pod-logs,cni/net.d,cni/networks,cni/cache,containerd}
done
chmod 700 "$STATE"
echo "$nodes" >"$STATE/nodes"

# --- what is changed outside the namespace, recorded before anything starts -------------------
for s in $SYSCTLS; do
  printf '%s=%s\n' "$s" "$(sysctl -n "$s")"
done >"$STATE/sysctls"
for p in $FIXED_PATHS; do
  [ -e "$p" ] && echo "$p"
done >"$STATE/preexisting" || true
for h in /sys/fs/cgroup/*/; do
  [ -e "$h/kubepods" ] && echo "$h"kubepods
done >"$STATE/preexisting-cgroups" || true
[ -s "$STATE/preexisting-cgroups" ] && die "kubepods cgroups exist already ($(head -1 "$STATE/preexisting-cgroups")): another kubelet runs here"
for ((i = 1; i < nodes; i++)); do
  for h in /sys/fs/cgroup/*/; do
    [ -e "$h$(node_name "$i")" ] && die "cgroup $h$(node_name "$i") exists already: another cluster runs here"
  done
done

# --- images: pause and the test server (static Go programs), kube-portal-proxy ----------------
log "building the pause and serve images"
(cd "$repo" && CGO_ENABLED=0 go build -trimpath -ldflags=-s -o "$STATE/bin/pause" ./hack/cluster/pause &&
  CGO_ENABLED=0 go build -trimpath -ldflags=-s -o "$STATE/bin/serve" ./hack/cluster/serve &&
  go run ./hack/oci -o "$STATE/images/pause.tar" -name "$PAUSE_IMAGE" -add "$STATE/bin/pause=/pause" \
    -entrypoint /pause -user 65535:65535 &&
  go run ./hack/oci -o "$STATE/images/serve.tar" -name "$SERVE_IMAGE" -add "$STATE/bin/serve=/serve" \
    -entrypoint /serve -user 65534:65534 &&
  go run ./hack/oci -o "$STATE/images/coredns.tar" -name "$COREDNS_IMAGE" -add "$KPP_COREDNS=/coredns" \
    -entrypoint /coredns)

# --- the namespace ---------------------------------------------------------------------------
if ((nodes == 1)); then
  log "network namespace $NS: lo, bridge node0 $NODE_CIDR, route $SERVICE_CIDR on node0, no default route"
  ip netns add "$NS"
  ns ip link set lo up
  ns ip link add node0 type bridge
  ns ip addr add "$NODE_CIDR" dev node0
  ns ip link set node0 up
  # Host traffic to service IPs needs a route for the kernel to hand it to the OUTPUT chain, where
  # the proxy's portal rules catch it; the bridge has no ports, so nothing is ever sent on it.
  ns ip route add "$SERVICE_CIDR" dev node0 src "$NODE_IP"
else
  # The switch: a namespace holding only bridge br0, so no node's netfilter sees the frames
  # between two others. Each node: eth0 (a veth whose peer nI is a port of br0) with the node IP,
  # the service range on eth0 (as above: the portal rules catch it in OUTPUT and PREROUTING),
  # and a route to every other node's pod CIDR via that node (the bridge CNI's cni0 gateway and
  # ip_forward do the rest). No default route anywhere.
  log "$nodes nodes: namespaces $NS (node 0) and $NS-node1.., eth0 on bridge br0 in $SWITCH_NS"
  ip netns add "$SWITCH_NS"
  ip -n "$SWITCH_NS" link set lo up
  ip -n "$SWITCH_NS" link add br0 type bridge
  ip -n "$SWITCH_NS" link set br0 up
  for ((i = 0; i < nodes; i++)); do
    n=$(node_netns "$i")
    ip netns add "$n"
    ip -n "$n" link set lo up
    ip -n "$SWITCH_NS" link add "n$i" type veth peer name eth0 netns "$n"
    ip -n "$SWITCH_NS" link set "n$i" master br0 up
    ip -n "$n" addr add "$(node_ip "$i")/24" dev eth0
    ip -n "$n" link set eth0 up
    ip -n "$n" route add "$SERVICE_CIDR" dev eth0 src "$(node_ip "$i")"
    for ((j = 0; j < nodes; j++)); do
      ((j == i)) || ip -n "$n" route add "$(node_pod_cidr "$j")" via "$(node_ip "$j")" dev eth0
    done
  done
  # Nodes 1..: a mount namespace each, so the paths kubelet, containerd's shims, the CNI cache
  # and the proxy's DaemonSet (hostPath /var/run/kube-portal-proxy: the hand-over socket)
  # fix are their own: a tmpfs on /run and bind mounts of $STATE/nodeI/fixed/* on the fixed
  # paths of $FIXED_PATHS under /var (and the copy of /run/netns dropped first: it would keep
  # the namespaces named there alive). The namespace files live on a private bind mount of
  # $STATE/mnt (down.sh unmounts them, which ends the namespaces). The mount points are
  # created on the host (recorded as absent above, so down.sh removes them).
  mkdir -p "$STATE/mnt"
  mount --bind "$STATE/mnt" "$STATE/mnt"
  mount --make-private "$STATE/mnt"
  var_paths=$(for p in $FIXED_PATHS; do case $p in /var/*) echo "$p" ;; esac; done)
  for p in $var_paths; do mkdir -p "$p"; done
  # Every node: a UTS namespace with the node's name as hostname (hostNetwork pods share it; the
  # upstream specs ask such pods for their hostname and expect the node's name).
  for ((i = 0; i < nodes; i++)); do
    touch "$(node_utsns "$i")"
    unshare --uts="$(node_utsns "$i")" hostname "$(node_name "$i")"
  done
  for ((i = 1; i < nodes; i++)); do
    d=$(node_dir "$i")
    binds=""
    for p in $var_paths; do
      f=$d/fixed/$(echo "${p#/}" | tr / -)
      mkdir -p "$f"
      binds+=" && mount --bind '$f' '$p'"
    done
    touch "$(node_mntns "$i")"
    unshare --mount="$(node_mntns "$i")" --propagation private \
      sh -c "umount -R -l /run/netns 2>/dev/null; mount -t tmpfs -o mode=0755 $(node_name "$i")-run /run$binds"
    # The node's own cgroup root for kubelet (cgroupRoot); cpuset needs its cpus and mems set
    # before anything can join it.
    for h in /sys/fs/cgroup/*/; do
      mkdir "$h$(node_name "$i")" && echo "$h$(node_name "$i")" >>"$STATE/created-cgroups"
    done
    cat /sys/fs/cgroup/cpuset/cpuset.cpus >"/sys/fs/cgroup/cpuset/$(node_name "$i")/cpuset.cpus"
    cat /sys/fs/cgroup/cpuset/cpuset.mems >"/sys/fs/cgroup/cpuset/$(node_name "$i")/cpuset.mems"
  done
fi

# start NAME COMMAND...: runs COMMAND in the namespace, in a session of its own, logging to
# logs/NAME.log, and records its PID (nsenter and setsid exec, so $! is the component itself).
# start_on I NAME COMMAND... does the same on node I (its network and mount namespaces).
start() { start_on 0 "$@"; }
# (nsenter itself, not node_exec: a backgrounded shell function would make $! a subshell's PID.)
start_on() {
  local i=$1 name=$2 nsargs=(--net="/run/netns/$(node_netns "$1")")
  shift 2
  ((i == 0)) || nsargs+=(--mount="$(node_mntns "$i")")
  [ ! -e "$(node_utsns "$i")" ] || nsargs+=(--uts="$(node_utsns "$i")")
  nsenter "${nsargs[@]}" setsid "$@" </dev/null >"$STATE/logs/$name.log" 2>&1 &
  echo $! >"$STATE/pids/$name"
  log "$name started (pid $!, log $STATE/logs/$name.log)"
}
alive() { kill -0 "$(cat "$STATE/pids/$1")" 2>/dev/null || die "$1 exited; see $STATE/logs/$1.log"; }

# --- credentials -------------------------------------------------------------------------------
openssl genrsa -out "$STATE/pki/sa.key" 2048 2>/dev/null
token() { openssl rand -hex 16; }
admin_token=$(token) kubelet_token=$(token) kcm_token=$(token) sched_token=$(token)
cat >"$STATE/pki/tokens.csv" <<TOKENS
$admin_token,kpp-admin,kpp-admin,"system:masters"
$kubelet_token,system:node:$NODE,system:node:$NODE,"system:nodes"
$kcm_token,system:kube-controller-manager,system:kube-controller-manager
$sched_token,system:kube-scheduler,system:kube-scheduler
TOKENS
node_tokens=("$kubelet_token")
for ((i = 1; i < nodes; i++)); do
  node_tokens[i]=$(token)
  echo "${node_tokens[i]},system:node:$(node_name "$i"),system:node:$(node_name "$i"),\"system:nodes\"" >>"$STATE/pki/tokens.csv"
done
chmod 600 "$STATE/pki/tokens.csv"

# --- etcd and kube-apiserver ---------------------------------------------------------------
start etcd "$KPP_ETCD" --name=kpp-cluster --data-dir="$STATE/etcd" \
  --listen-client-urls=http://127.0.0.1:2379 --advertise-client-urls=http://127.0.0.1:2379 \
  --listen-peer-urls=http://127.0.0.1:2380 --initial-advertise-peer-urls=http://127.0.0.1:2380 \
  --initial-cluster=kpp-cluster=http://127.0.0.1:2380 --unsafe-no-fsync --log-level=warn
apiserver_args=(--etcd-servers=http://127.0.0.1:2379
  --bind-address=0.0.0.0 --advertise-address="$NODE_IP" --secure-port=6443
  --cert-dir="$STATE/pki/apiserver" --token-auth-file="$STATE/pki/tokens.csv"
  --authorization-mode=Node,RBAC --allow-privileged=true
  --service-account-issuer=https://kubernetes.default.svc.cluster.local
  --service-account-key-file="$STATE/pki/sa.key" --service-account-signing-key-file="$STATE/pki/sa.key"
  --service-cluster-ip-range="$SERVICE_CIDR" --kubelet-preferred-address-types=InternalIP
  --profiling=false)
start kube-apiserver "$KPP_APISERVER" "${apiserver_args[@]}"
ca=$STATE/pki/apiserver/apiserver.crt
wait_for "the API server's certificate" 60 test -s "$ca"

kubeconfig() { # FILE USER TOKEN
  local k=(ns "$KPP_KUBECTL" --kubeconfig="$1" config)
  "${k[@]}" set-cluster kpp --server="https://$NODE_IP:6443" --certificate-authority="$ca" --embed-certs=true >/dev/null
  "${k[@]}" set-credentials "$2" --token="$3" >/dev/null
  "${k[@]}" set-context kpp --cluster=kpp --user="$2" >/dev/null
  "${k[@]}" use-context kpp >/dev/null
  chmod 600 "$1"
}
kubeconfig "$KUBECONFIG_ADMIN" kpp-admin "$admin_token"
for ((i = 0; i < nodes; i++)); do
  kubeconfig "$(node_dir "$i")/kubelet.kubeconfig" "system:node:$(node_name "$i")" "${node_tokens[i]}"
done
kubeconfig "$STATE/kcm.kubeconfig" system:kube-controller-manager "$kcm_token"
kubeconfig "$STATE/scheduler.kubeconfig" system:kube-scheduler "$sched_token"
wait_for "the API server's /readyz" 120 kc get --raw /readyz
alive etcd
alive kube-apiserver

start_controllers() {
  start kube-controller-manager "$KPP_CONTROLLER_MANAGER" --kubeconfig="$STATE/kcm.kubeconfig" \
    --authentication-kubeconfig="$STATE/kcm.kubeconfig" --authorization-kubeconfig="$STATE/kcm.kubeconfig" \
    --leader-elect=false --use-service-account-credentials=true \
    --service-account-private-key-file="$STATE/pki/sa.key" --root-ca-file="$ca" \
    --service-cluster-ip-range="$SERVICE_CIDR" --bind-address=127.0.0.1
  start kube-scheduler "$KPP_SCHEDULER" --kubeconfig="$STATE/scheduler.kubeconfig" \
    --authentication-kubeconfig="$STATE/scheduler.kubeconfig" --authorization-kubeconfig="$STATE/scheduler.kubeconfig" \
    --leader-elect=false --bind-address=127.0.0.1
}
static_pod=""
if ((nodes == 1)); then
  start_controllers
else
  # Several nodes: the API server becomes a static pod of node 0's kubelet, as kubeadm and kind
  # run it (kube-system/kube-apiserver-kpp-node0, labels component=kube-apiserver,
  # tier=control-plane), so that the upstream "should work after restarting apiserver" spec
  # finds it. The process above only made the serving certificate the kubeconfigs name and
  # proved the flags; the pod runs the same binary with the same flags and files (hostPath
  # $STATE/pki) from an image of it. The controllers start once the pod serves.
  stop_apiserver=$(cat "$STATE/pids/kube-apiserver")
  kill -TERM "$stop_apiserver"
  wait_for "the API server process to exit" 30 sh -c "! kill -0 $stop_apiserver" || die "kube-apiserver (pid $stop_apiserver) did not exit"
  rm -f "$STATE/pids/kube-apiserver"
  (cd "$repo" && go run ./hack/oci -o "$STATE/images/kube-apiserver.tar" -name "$APISERVER_IMAGE" \
    -add "$KPP_APISERVER=/usr/local/bin/kube-apiserver" -entrypoint /usr/local/bin/kube-apiserver)
  {
    cat <<POD
apiVersion: v1
kind: Pod
metadata:
  name: kube-apiserver
  namespace: kube-system
  labels: {component: kube-apiserver, tier: control-plane}
spec:
  hostNetwork: true
  priorityClassName: system-node-critical
  containers:
  - name: kube-apiserver
    image: $APISERVER_IMAGE
    imagePullPolicy: Never
    command:
    - /usr/local/bin/kube-apiserver
POD
    for a in "${apiserver_args[@]}"; do printf '    - "%s"\n' "$a"; done
    cat <<POD
    volumeMounts: [{name: pki, mountPath: "$STATE/pki"}]
  volumes: [{name: pki, hostPath: {path: "$STATE/pki", type: Directory}}]
POD
  } >"$STATE/manifests/kube-apiserver.yaml"
  static_pod="staticPodPath: $STATE/manifests"
fi

# --- containerd and kubelet on each node -------------------------------------------------------
echo "nameserver $NODE_IP" >"$STATE/resolv.conf"   # nothing answers: pods with dnsPolicy Default resolve nothing

# node_start I: configures and starts node I's containerd (its root, state, socket and CNI
# configuration under node_dir I), imports the images into it, then starts its kubelet.
node_start() {
  local i=$1 d c sock suffix="" cgroup_root=""
  d=$(node_dir "$i")
  c=$d/containerd
  sock=$(node_sock "$i")
  if ((i > 0)); then
    suffix=-node$i
    cgroup_root="cgroupRoot: /$(node_name "$i")"
  fi
  containerd config default |
    sed -e "s#^root = .*#root = \"$c/root\"#" \
      -e "s#^state = .*#state = \"$c/state\"#" \
      -e "s#^temp = .*#temp = \"$c/tmp\"#" \
      -e "/^\[grpc\]/,/^\[/ s#^  address = .*#  address = \"$sock\"#" \
      -e "s#sandbox_image = .*#sandbox_image = \"$PAUSE_IMAGE\"#" \
      -e "s#SystemdCgroup = .*#SystemdCgroup = false#" \
      -e "s#bin_dir = \"/opt/cni/bin\"#bin_dir = \"/usr/lib/cni\"#" \
      -e "s#conf_dir = \"/etc/cni/net.d\"#conf_dir = \"$d/cni/net.d\"#" \
      -e "s#netns_mounts_under_state_dir = .*#netns_mounts_under_state_dir = true#" \
      -e "s#restrict_oom_score_adj = .*#restrict_oom_score_adj = true#" >"$c/config.toml"
  grep -q "address = \"$sock\"" "$c/config.toml" || die "containerd config: socket not set"
  mkdir -p "$c/tmp"
  cat >"$d/cni/net.d/10-kpp.conflist" <<CNI
{
  "cniVersion": "1.0.0",
  "name": "kpp",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$d/cni/networks",
              "ranges": [[{"subnet": "$(node_pod_cidr "$i")"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}},
    {"type": "loopback"}
  ]
}
CNI
  start_on "$i" "containerd$suffix" containerd --config="$c/config.toml"
  wait_for "containerd$suffix" 60 ctr -a "$sock" version
  alive "containerd$suffix"
  local extra=()
  ((i > 0)) || [ -z "$static_pod" ] || extra=("$STATE/images/kube-apiserver.tar")
  for img in "$STATE/images/pause.tar" "$STATE/images/serve.tar" "$STATE/images/coredns.tar" "$IMAGE_OCI" "${extra[@]}"; do
    ctr -a "$sock" -n k8s.io images import "$img" >/dev/null
  done
  log "images imported on $(node_name "$i"): $(ctr -a "$sock" -n k8s.io images ls -q | grep -v '^sha256:' | tr '\n' ' ')"

  cat >"$d/kubelet.yaml" <<KUBELET
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
$cgroup_root
$( ((i == 0)) && echo "$static_pod")
containerRuntimeEndpoint: unix://$sock
imageServiceEndpoint: unix://$sock
protectKernelDefaults: false
failSwapOn: false
address: $(node_ip "$i")
healthzBindAddress: 127.0.0.1
readOnlyPort: 0
podLogsDir: $d/pod-logs
resolvConf: $STATE/resolv.conf
clusterDomain: cluster.local
clusterDNS: [$DNS_IP]
# The API server presents no client certificate; nothing outside the namespace reaches 10250.
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
evictionHard: {memory.available: 50Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
KUBELET
  start_on "$i" "kubelet$suffix" "$KPP_KUBELET" --config="$d/kubelet.yaml" --kubeconfig="$d/kubelet.kubeconfig" \
    --root-dir="$d/kubelet" --cert-dir="$d/kubelet/pki" --node-ip="$(node_ip "$i")" --hostname-override="$(node_name "$i")"
}

kubelet_started=$SECONDS
for ((i = 0; i < nodes; i++)); do
  node_start "$i"
done
if [ -n "$static_pod" ]; then
  wait_for "the API server's static pod to serve /readyz" 180 kc get --raw /readyz ||
    die "the kube-apiserver static pod does not serve; see $STATE/pod-logs/kube-system_kube-apiserver-*"
  log "kube-apiserver runs as node 0's static pod $((SECONDS - kubelet_started))s after the first containerd started"
  start_controllers
fi
for ((i = 0; i < nodes; i++)); do
  n=$(node_name "$i")
  wait_for "node $n to register" 120 kc get node "$n"
  kc wait --for=condition=Ready "node/$n" --timeout=120s >/dev/null || die "node $n not Ready; see $STATE/logs/kubelet*.log"
  # The node's pod CIDR in its spec, as the controller manager's node IPAM (--allocate-node-cidrs)
  # would set it: the range its host-local CNI config hands out. The proxy's transparent source
  # mode reads it (a client in it is a pod of this node).
  kc patch node "$n" --type=merge -p "{\"spec\":{\"podCIDR\":\"$(node_pod_cidr "$i")\",\"podCIDRs\":[\"$(node_pod_cidr "$i")\"]}}" >/dev/null ||
    die "cannot set node $n's podCIDR"
  log "node $n Ready $((SECONDS - kubelet_started))s after the first containerd started"
done
alive kube-controller-manager
alive kube-scheduler

# --- kube-portal-proxy, as a user installs it -------------------------------------------------
# KPP_INSTALL=helm installs the Helm chart (deploy/helm/kube-portal-proxy) instead of deploy/:
# the same objects, with the image, the API server's address and, when needed, the capabilities
# as values. KPP_HELM_SET adds values of the caller's (helm --set syntax), e.g.
# KPP_HELM_SET=proxy.defaultDataPath=kernel for the conformance run on the kernel data path. Helm's cache and config go under $STATE, which make cluster-down removes.
no_sys_resource=0
# CAP_SYS_RESOURCE is bit 24 of the bounding set.
if (( (16#$(awk '/^CapBnd/ {print $2}' /proc/self/status) >> 24 & 1) == 0 )); then
  no_sys_resource=1
fi
case ${KPP_INSTALL:-kustomize} in
helm)
  helm_bin=$(command -v helm) || die "KPP_INSTALL=helm: helm not found (hack/install-deps.sh monitoring)"
  sets=()
  if [ "$no_sys_resource" = 1 ]; then
    log "root lacks CAP_SYS_RESOURCE here: the DaemonSet runs without it (securityContext.capabilities)"
    sets=(--set 'securityContext.capabilities={NET_ADMIN,NET_RAW,NET_BIND_SERVICE}')
  fi
  if ((nodes > 1)); then
    # As overlay/kube-proxy-label.yaml below: the pods also carry k8s-app=kube-proxy, which the
    # upstream "should work after restarting kube-proxy" spec deletes them by.
    sets+=(--set-string 'podLabels.k8s-app=kube-proxy')
    # As overlay/kube-proxy-conntrack.yaml: privileged, with kube-proxy's conntrack TCP timeouts.
    sets+=(--set securityContext.privileged=true --set-string proxy.conntrack.tcpEstablishedTimeout=24h
      --set-string proxy.conntrack.tcpCloseWaitTimeout=1h)
  fi
  HELM_CACHE_HOME="$STATE/helm/cache" HELM_CONFIG_HOME="$STATE/helm/config" HELM_DATA_HOME="$STATE/helm/data" \
    ns "$helm_bin" --kubeconfig="$KUBECONFIG_ADMIN" install kube-portal-proxy "$repo/deploy/helm/kube-portal-proxy" \
    --namespace kube-system --set-string image.repository="${IMAGE%:*}" --set-string image.tag="${IMAGE##*:}" \
    --set-string apiServer.host="$NODE_IP" --set-string apiServer.port=6443 "${sets[@]}" \
    ${KPP_HELM_SET:+--set "$KPP_HELM_SET"} >/dev/null
  log "kube-portal-proxy installed from the Helm chart"
  ;;
kustomize)
  # The overlay only changes the image and, as kube-proxy's installers do, gives the proxy the API
  # server's address: in-cluster configuration names the kubernetes Service, which nothing serves
  # before the proxy runs.
  rel=$(realpath --relative-to="$STATE/overlay" "$repo/deploy")
  sed -e "s#@DEPLOY@#$rel#" -e "s#@IMAGE_NAME@#${IMAGE%:*}#" -e "s#@IMAGE_TAG@#${IMAGE##*:}#" \
    -e "s#@API_HOST@#$NODE_IP#" -e "s#@API_PORT@#6443#" \
    "$here/overlay/kustomization.yaml.in" >"$STATE/overlay/kustomization.yaml"
  cp "$here/overlay/apiserver-env.yaml" "$STATE/overlay/"
  sed -i -e "s#@API_HOST@#$NODE_IP#" -e "s#@API_PORT@#6443#" "$STATE/overlay/apiserver-env.yaml"
  if [ "$no_sys_resource" = 1 ]; then
    log "root lacks CAP_SYS_RESOURCE here: the DaemonSet runs without it (overlay/no-sys-resource.yaml)"
    cp "$here/overlay/no-sys-resource.yaml" "$STATE/overlay/"
    printf -- '- path: no-sys-resource.yaml\n' >>"$STATE/overlay/kustomization.yaml"
  fi
  if ((nodes > 1)); then
    # The label kube-proxy's pods carry: the upstream "should work after restarting kube-proxy"
    # spec restarts the service proxy by deleting the kube-system pods labelled k8s-app=kube-proxy.
    # Not on one node, where make cluster-swap runs kubeadm's kube-proxy DaemonSet (that selector).
    cp "$here/overlay/kube-proxy-label.yaml" "$here/overlay/kube-proxy-conntrack.yaml" "$STATE/overlay/"
    printf -- '- path: kube-proxy-label.yaml\n' >>"$STATE/overlay/kustomization.yaml"
    # And privileged with kube-proxy's conntrack TCP timeouts, as kubeadm runs kube-proxy (the
    # KubeProxy CLOSE_WAIT spec checks the node's close-wait timeout).
    printf -- '- path: kube-proxy-conntrack.yaml\n  target: {kind: DaemonSet, name: kube-portal-proxy}\n' \
      >>"$STATE/overlay/kustomization.yaml"
  fi
  kc apply -k "$STATE/overlay" >/dev/null
  ;;
*) die "KPP_INSTALL=$KPP_INSTALL: want kustomize (the default) or helm" ;;
esac
kc -n kube-system rollout status daemonset/kube-portal-proxy --timeout=180s >/dev/null ||
  die "kube-portal-proxy not ready; kubectl -n kube-system logs ds/kube-portal-proxy"
log "kube-portal-proxy DaemonSet ready"

# --- cluster DNS: CoreDNS as kubeadm installs it (it reaches the API server through the
# kubernetes Service, so through the proxy) ------------------------------------------------------
sed -e "s#@IMAGE@#$COREDNS_IMAGE#" -e "s#@DNS_IP@#$DNS_IP#" "$here/coredns.yaml" | kc apply -f - >/dev/null
kc -n kube-system rollout status deployment/coredns --timeout=180s >/dev/null ||
  die "CoreDNS not ready; kubectl -n kube-system logs deploy/coredns"
log "CoreDNS ready at $DNS_IP; cluster up in $((SECONDS - started))s"

cat <<USAGE

The cluster runs in network namespace $NS (node $NODE, $NODE_IP$( ((nodes > 1)) && echo "; $((nodes - 1)) more node(s) in $NS-node1.., their kubelets' and containerds' files in $STATE/node1..")). Use it from there:

  alias k='nsenter --net=/run/netns/$NS $KPP_KUBECTL --kubeconfig=$KUBECONFIG_ADMIN'
  k get nodes,pods -A -o wide

Logs: $STATE/logs/.  Smoke test: make cluster-smoke.  Remove everything: make cluster-down.
USAGE
