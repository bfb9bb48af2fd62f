#!/usr/bin/env bash
# swap.sh exercises docs/install.md, "Replace kube-proxy in place (kubeadm)", on a
# running make cluster (make cluster-swap): kube-proxy's own objects as kubeadm v1.36 writes them
# (ServiceAccount kube-proxy, ClusterRoleBinding kubeadm:node-proxier, ConfigMap kube-proxy with
# kubeconfig.conf and the full defaulted config.conf, DaemonSet kube-proxy: privileged, command
# /usr/local/bin/kube-proxy --config=/var/lib/kube-proxy/config.conf --hostname-override=$(NODE_NAME))
# with only the image swapped for kube-portal-proxy's, take over the node from the kube-portal-proxy
# DaemonSet. A Service (two serve pods) is checked before, while the kube-proxy DaemonSet runs, and
# after deploy/'s DaemonSet is back. Leaves the cluster as it found it.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source=common.sh
. "$here/common.sh"
need_cluster cluster-swap

fail() { log "FAIL: $*"; exit 1; }
cleanup() {
  kc -n kube-system delete daemonset kube-proxy --ignore-not-found --wait=true >/dev/null 2>&1 || true
  kc -n kube-system delete configmap kube-proxy --ignore-not-found >/dev/null 2>&1 || true
  kc -n kube-system delete serviceaccount kube-proxy --ignore-not-found >/dev/null 2>&1 || true
  kc delete clusterrolebinding kubeadm:node-proxier --ignore-not-found >/dev/null 2>&1 || true
  kc apply -k "$STATE/overlay" >/dev/null 2>&1 || true
  kc delete namespace swap --wait=false >/dev/null 2>&1 || true
}
trap cleanup EXIT

image=$(kc -n kube-system get daemonset kube-portal-proxy -o jsonpath='{.spec.template.spec.containers[0].image}') ||
  fail "no kube-portal-proxy DaemonSet (make cluster installs it)"
conntrack_max_before=$(sysctl -n net.netfilter.nf_conntrack_max 2>/dev/null || echo none)

kc create namespace swap >/dev/null
{ serve_deployment; echo ---; cat <<YAML; } | kc -n swap apply -f - >/dev/null
apiVersion: v1
kind: Service
metadata: {name: serve}
spec:
  selector: {app: serve}
  ports: [{port: 80, targetPort: 8080}]
YAML
kc -n swap rollout status deployment/serve --timeout=120s >/dev/null || fail "serve pods not ready"
ip=$(kc -n swap get service serve -o jsonpath='{.spec.clusterIP}')
pods=$(kc -n swap get pods -l app=serve -o jsonpath='{.items[*].metadata.name}')

# both_answer succeeds once consecutive requests to the Service reach two different serve pods.
both_answer() {
  local first second
  first=$(ns "$STATE/bin/serve" -get "http://$ip/" 2>/dev/null) || return 1
  second=$(ns "$STATE/bin/serve" -get "http://$ip/" 2>/dev/null) || return 1
  [ "$first" != "$second" ]
}

# answers N: N requests from the node to the Service, each answered by a serve pod, both pods seen.
answers() {
  local n=$1 seen="" out i
  wait_for "the first answer of $ip:80" 60 ns "$STATE/bin/serve" -get "http://$ip/" || fail "$ip:80 does not answer"
  # Both pods Ready does not mean both are in the proxy's endpoints yet: the EndpointSlice
  # controller and the proxy's watch follow a moment later.
  wait_for "both pods behind $ip:80" 30 both_answer || fail "$ip:80 is not answered by both pods"
  for ((i = 0; i < n; i++)); do
    out=$(ns "$STATE/bin/serve" -get "http://$ip/" 2>&1) || fail "request $i to $ip:80: $out"
    case " $pods " in *" $out "*) ;; *) fail "answer '$out' is not a serve pod" ;; esac
    case " $seen " in *" $out "*) ;; *) seen="$seen $out" ;; esac
  done
  [ "$(wc -w <<<"$seen")" = 2 ] || fail "$n requests reached only$seen"
}
answers 10
log "before: Service swap/serve $ip:80 answered by both pods through the kube-portal-proxy DaemonSet"

# kubeadm's objects (cmd/kubeadm/app/phases/addons/proxy), image swapped. config.conf is the
# defaulted KubeProxyConfiguration kubeadm writes (daemon/testdata/config/kubeadm-defaults.yaml,
# which the daemon's tests decode), with this cluster's pod CIDR.
config=$(sed -e '/^#/d' -e "s#^clusterCIDR: .*#clusterCIDR: $POD_CIDR#" "$repo/daemon/testdata/config/kubeadm-defaults.yaml" | sed 's/^/    /')
kc apply -f - >/dev/null <<YAML
apiVersion: v1
kind: ServiceAccount
metadata: {name: kube-proxy, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "kubeadm:node-proxier"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:node-proxier"}
subjects:
- {kind: ServiceAccount, name: kube-proxy, namespace: kube-system}
---
kind: ConfigMap
apiVersion: v1
metadata:
  name: kube-proxy
  namespace: kube-system
  labels: {app: kube-proxy}
data:
  kubeconfig.conf: |-
    apiVersion: v1
    kind: Config
    clusters:
    - cluster:
        certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt
        server: https://$NODE_IP:6443
      name: default
    contexts:
    - context:
        cluster: default
        namespace: default
        user: default
      name: default
    current-context: default
    users:
    - name: default
      user:
        tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token
  config.conf: |-
$config
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  labels: {k8s-app: kube-proxy}
  name: kube-proxy
  namespace: kube-system
spec:
  selector:
    matchLabels: {k8s-app: kube-proxy}
  updateStrategy: {type: RollingUpdate}
  template:
    metadata:
      labels: {k8s-app: kube-proxy}
    spec:
      priorityClassName: system-node-critical
      containers:
      - name: kube-proxy
        image: $image
        imagePullPolicy: IfNotPresent
        command:
        - /usr/local/bin/kube-proxy
        - --config=/var/lib/kube-proxy/config.conf
        - --hostname-override=\$(NODE_NAME)
        securityContext:
          privileged: true
        volumeMounts:
        - {mountPath: /var/lib/kube-proxy, name: kube-proxy}
        - {mountPath: /run/xtables.lock, name: xtables-lock, readOnly: false}
        - {mountPath: /lib/modules, name: lib-modules, readOnly: true}
        env:
        - name: NODE_NAME
          valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
      hostNetwork: true
      serviceAccountName: kube-proxy
      volumes:
      - name: kube-proxy
        configMap: {name: kube-proxy}
      - name: xtables-lock
        hostPath: {path: /run/xtables.lock, type: FileOrCreate}
      - name: lib-modules
        hostPath: {path: /lib/modules}
      tolerations:
      - operator: Exists
      nodeSelector: {kubernetes.io/os: linux}
YAML
# The swap: deploy/'s DaemonSet goes (its portal rules stay, on purpose), kubeadm's takes over.
t0=$SECONDS
kc -n kube-system delete daemonset kube-portal-proxy --cascade=foreground --wait=true >/dev/null
wait_for "the kube-portal-proxy pods to be gone" 60 sh -c \
  "[ -z \"\$(nsenter --net=/run/netns/$NS $KPP_KUBECTL --kubeconfig=$KUBECONFIG_ADMIN -n kube-system get pods -l app.kubernetes.io/name=kube-portal-proxy -o name)\" ]" ||
  fail "kube-portal-proxy's pod did not go"
kc -n kube-system rollout status daemonset/kube-proxy --timeout=180s >/dev/null ||
  fail "kubeadm's kube-proxy DaemonSet with our image not ready: $(kc -n kube-system logs ds/kube-proxy --tail=20 2>&1)"
answers 20
log "swapped: kube-system/kube-proxy (kubeadm's DaemonSet and config.conf, image $image) serves $ip:80, both pods answer ($((SECONDS - t0))s after the swap began)"
pod=$(kc -n kube-system get pods -l k8s-app=kube-proxy -o jsonpath='{.items[0].metadata.name}')
cmd=$(kc -n kube-system get pod "$pod" -o jsonpath='{.spec.containers[0].command}')
mode=$(ns "$STATE/bin/serve" -get http://127.0.0.1:10249/proxyMode) || fail "no /proxyMode on the node"
[ "$mode" = userspace ] || fail "/proxyMode = $mode, want userspace"
log "pod $pod runs $cmd; /proxyMode = $mode"
kc -n kube-system logs "$pod" 2>&1 | grep -iE 'level=(warn|error)' | head -5 | sed 's/^/cluster:   proxy log: /' >&2 || true

# And back: deploy/'s DaemonSet again, kube-proxy's objects removed.
kc -n kube-system delete daemonset kube-proxy --cascade=foreground --wait=true >/dev/null
kc apply -k "$STATE/overlay" >/dev/null
kc -n kube-system rollout status daemonset/kube-portal-proxy --timeout=180s >/dev/null || fail "kube-portal-proxy not back"
answers 10
log "back: kube-portal-proxy DaemonSet from deploy/ serves $ip:80 again"
conntrack_max_after=$(sysctl -n net.netfilter.nf_conntrack_max 2>/dev/null || echo none)
[ "$conntrack_max_before" = "$conntrack_max_after" ] ||
  fail "the root namespace's nf_conntrack_max changed: $conntrack_max_before -> $conntrack_max_after"
log "PASS"
