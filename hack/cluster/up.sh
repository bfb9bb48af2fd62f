#!/usr/bin/env bash
# up.sh starts a single-node Kubernetes cluster entirely inside a network namespace of its own
# (make cluster; see README "Real cluster"): etcd, kube-apiserver, kube-controller-manager,
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
# Environment: IMAGE, IMAGE_OCI (the kube-portal-proxy image and its tarball, from make),
# KPP_CLUSTER_DIR (default /var/lib/kpp-cluster), KPP_CLUSTER_NETNS (default kpp-cluster).
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
[ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] && [ -x /usr/lib/cni/loopback ] ||
  die "CNI plugins not found in /usr/lib/cni: apt-get install containernetworking-plugins"
[ -e "/run/netns/$NS" ] && die "network namespace $NS exists: the cluster is up (make cluster-down first)"
[ -e "$STATE" ] && die "$STATE exists: the cluster is up or was not removed (make cluster-down)"

started=$SECONDS
eval "$("$repo/hack/controlplane-build.sh")"
eval "$("$here/build.sh")"

mkdir -p "$STATE"/{pids,logs,pki,images,bin,etcd,kubelet/pki,pod-logs,cni/net.d,cni/networks,cni/cache,containerd,overlay,manifests}
chmod 700 "$STATE"

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
log "network namespace $NS: lo, bridge node0 $NODE_CIDR, route $SERVICE_CIDR on node0, no default route"
ip netns add "$NS"
ns ip link set lo up
ns ip link add node0 type bridge
ns ip addr add "$NODE_CIDR" dev node0
ns ip link set node0 up
# Host traffic to service IPs needs a route for the kernel to hand it to the OUTPUT chain, where
# the proxy's portal rules catch it; the bridge has no ports, so nothing is ever sent on it.
ns ip route add "$SERVICE_CIDR" dev node0 src "$NODE_IP"

# start NAME COMMAND...: runs COMMAND in the namespace, in a session of its own, logging to
# logs/NAME.log, and records its PID (nsenter and setsid exec, so $! is the component itself).
start() {
  local name=$1
  shift
  nsenter --net="/run/netns/$NS" setsid "$@" </dev/null >"$STATE/logs/$name.log" 2>&1 &
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
chmod 600 "$STATE/pki/tokens.csv"

# --- etcd and kube-apiserver ---------------------------------------------------------------
start etcd "$KPP_ETCD" --name=kpp-cluster --data-dir="$STATE/etcd" \
  --listen-client-urls=http://127.0.0.1:2379 --advertise-client-urls=http://127.0.0.1:2379 \
  --listen-peer-urls=http://127.0.0.1:2380 --initial-advertise-peer-urls=http://127.0.0.1:2380 \
  --initial-cluster=kpp-cluster=http://127.0.0.1:2380 --unsafe-no-fsync --log-level=warn
start kube-apiserver "$KPP_APISERVER" --etcd-servers=http://127.0.0.1:2379 \
  --bind-address=0.0.0.0 --advertise-address="$NODE_IP" --secure-port=6443 \
  --cert-dir="$STATE/pki/apiserver" --token-auth-file="$STATE/pki/tokens.csv" \
  --authorization-mode=Node,RBAC --allow-privileged=true \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$STATE/pki/sa.key" --service-account-signing-key-file="$STATE/pki/sa.key" \
  --service-cluster-ip-range="$SERVICE_CIDR" --kubelet-preferred-address-types=InternalIP \
  --profiling=false
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
kubeconfig "$STATE/kubelet.kubeconfig" "system:node:$NODE" "$kubelet_token"
kubeconfig "$STATE/kcm.kubeconfig" system:kube-controller-manager "$kcm_token"
kubeconfig "$STATE/scheduler.kubeconfig" system:kube-scheduler "$sched_token"
wait_for "the API server's /readyz" 120 kc get --raw /readyz
alive etcd
alive kube-apiserver

start kube-controller-manager "$KPP_CONTROLLER_MANAGER" --kubeconfig="$STATE/kcm.kubeconfig" \
  --authentication-kubeconfig="$STATE/kcm.kubeconfig" --authorization-kubeconfig="$STATE/kcm.kubeconfig" \
  --leader-elect=false --use-service-account-credentials=true \
  --service-account-private-key-file="$STATE/pki/sa.key" --root-ca-file="$ca" \
  --service-cluster-ip-range="$SERVICE_CIDR" --bind-address=127.0.0.1
start kube-scheduler "$KPP_SCHEDULER" --kubeconfig="$STATE/scheduler.kubeconfig" \
  --authentication-kubeconfig="$STATE/scheduler.kubeconfig" --authorization-kubeconfig="$STATE/scheduler.kubeconfig" \
  --leader-elect=false --bind-address=127.0.0.1

# --- containerd --------------------------------------------------------------------------------
c=$STATE/containerd
containerd config default |
  sed -e "s#^root = .*#root = \"$c/root\"#" \
    -e "s#^state = .*#state = \"$c/state\"#" \
    -e "s#^temp = .*#temp = \"$c/tmp\"#" \
    -e "/^\[grpc\]/,/^\[/ s#^  address = .*#  address = \"$SOCK\"#" \
    -e "s#sandbox_image = .*#sandbox_image = \"$PAUSE_IMAGE\"#" \
    -e "s#SystemdCgroup = .*#SystemdCgroup = false#" \
    -e "s#bin_dir = \"/opt/cni/bin\"#bin_dir = \"/usr/lib/cni\"#" \
    -e "s#conf_dir = \"/etc/cni/net.d\"#conf_dir = \"$STATE/cni/net.d\"#" \
    -e "s#netns_mounts_under_state_dir = .*#netns_mounts_under_state_dir = true#" \
    -e "s#restrict_oom_score_adj = .*#restrict_oom_score_adj = true#" >"$c/config.toml"
grep -q "address = \"$SOCK\"" "$c/config.toml" || die "containerd config: socket not set"
mkdir -p "$c/tmp"
cat >"$STATE/cni/net.d/10-kpp.conflist" <<CNI
{
  "cniVersion": "1.0.0",
  "name": "kpp",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$STATE/cni/networks",
              "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "loopback"}
  ]
}
CNI
start containerd containerd --config="$c/config.toml"
wait_for "containerd" 60 ctr -a "$SOCK" version
alive containerd
for img in "$STATE/images/pause.tar" "$STATE/images/serve.tar" "$STATE/images/coredns.tar" "$IMAGE_OCI"; do
  ctr -a "$SOCK" -n k8s.io images import "$img" >/dev/null
done
log "images imported: $(ctr -a "$SOCK" -n k8s.io images ls -q | grep -v '^sha256:' | tr '\n' ' ')"

# --- kubelet ---------------------------------------------------------------------------------
echo "nameserver $NODE_IP" >"$STATE/resolv.conf"   # nothing answers: pods with dnsPolicy Default resolve nothing
cat >"$STATE/kubelet.yaml" <<KUBELET
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$SOCK
imageServiceEndpoint: unix://$SOCK
protectKernelDefaults: false
failSwapOn: false
address: $NODE_IP
healthzBindAddress: 127.0.0.1
readOnlyPort: 0
podLogsDir: $STATE/pod-logs
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
kubelet_started=$SECONDS
start kubelet "$KPP_KUBELET" --config="$STATE/kubelet.yaml" --kubeconfig="$STATE/kubelet.kubeconfig" \
  --root-dir="$STATE/kubelet" --cert-dir="$STATE/kubelet/pki" --node-ip="$NODE_IP" --hostname-override="$NODE"
wait_for "node $NODE to register" 120 kc get node "$NODE"
kc wait --for=condition=Ready "node/$NODE" --timeout=120s >/dev/null || die "node not Ready; see $STATE/logs/kubelet.log"
log "node $NODE Ready $((SECONDS - kubelet_started))s after kubelet started"
alive kube-controller-manager
alive kube-scheduler

# --- kube-portal-proxy, as a user installs it -------------------------------------------------
# KPP_INSTALL=helm installs the Helm chart (deploy/helm/kube-portal-proxy) instead of deploy/:
# the same objects, with the image, the API server's address and, when needed, the capabilities
# as values. Helm's cache and config go under $STATE, which make cluster-down removes.
no_sys_resource=0
# CAP_SYS_RESOURCE is bit 24 of the bounding set.
if (( (16#$(awk '/^CapBnd/ {print $2}' /proc/self/status) >> 24 & 1) == 0 )); then
  no_sys_resource=1
fi
case ${KPP_INSTALL:-kustomize} in
helm)
  helm_bin=$(command -v helm) || die "KPP_INSTALL=helm: helm not found (hack/install-deps.sh monitoring)"
  caps=()
  if [ "$no_sys_resource" = 1 ]; then
    log "root lacks CAP_SYS_RESOURCE here: the DaemonSet runs without it (securityContext.capabilities)"
    caps=(--set 'securityContext.capabilities={NET_ADMIN,NET_RAW,NET_BIND_SERVICE}')
  fi
  HELM_CACHE_HOME="$STATE/helm/cache" HELM_CONFIG_HOME="$STATE/helm/config" HELM_DATA_HOME="$STATE/helm/data" \
    ns "$helm_bin" --kubeconfig="$KUBECONFIG_ADMIN" install kube-portal-proxy "$repo/deploy/helm/kube-portal-proxy" \
    --namespace kube-system --set-string image.repository="${IMAGE%:*}" --set-string image.tag="${IMAGE##*:}" \
    --set-string apiServer.host="$NODE_IP" --set-string apiServer.port=6443 "${caps[@]}" >/dev/null
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

The cluster runs in network namespace $NS (node $NODE, $NODE_IP). Use it from there:

  alias k='nsenter --net=/run/netns/$NS $KPP_KUBECTL --kubeconfig=$KUBECONFIG_ADMIN'
  k get nodes,pods -A -o wide

Logs: $STATE/logs/.  Smoke test: make cluster-smoke.  Remove everything: make cluster-down.
USAGE
