#!/usr/bin/env bash
# smoke.sh checks a running make cluster (make cluster-smoke): two serve pods behind a ClusterIP
# Service are reached through the Service IP, both from a pod (kubectl exec) and from the node
# (the cluster namespace), and the answers come from both endpoints. It asserts that the proxy
# answering on the node is the DaemonSet's kube-portal-proxy (/proxyMode, the rules it dumps
# name the Service IP). On a cluster of several nodes (make cluster NODES=3) it checks the
# same from every node, whose proxy reaches pods on the other nodes over the routed pod network.
# Leaves nothing behind (the smoke namespace is deleted).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=common.sh
. "$here/common.sh"
need_cluster cluster-smoke

fail() { log "FAIL: $*"; exit 1; }
trap 'kc delete namespace smoke --wait=false >/dev/null 2>&1 || true' EXIT

kc create namespace smoke >/dev/null
{ serve_deployment; echo ---; cat <<YAML; } | kc -n smoke apply -f - >/dev/null
apiVersion: v1
kind: Service
metadata: {name: serve}
spec:
  selector: {app: serve}
  ports: [{port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: client}
spec:
  containers:
  - name: client
    image: $SERVE_IMAGE
    imagePullPolicy: Never
    args: [-listen, ":8080"]
YAML
t0=$SECONDS
kc -n smoke rollout status deployment/serve --timeout=120s >/dev/null || fail "deployment not ready"
kc -n smoke wait --for=condition=Ready pod/client --timeout=120s >/dev/null || fail "client pod not ready"
log "2 serve pods and a client pod Ready in $((SECONDS - t0))s"
ip=$(kc -n smoke get service serve -o jsonpath='{.spec.clusterIP}')
pods=$(kc -n smoke get pods -l app=serve -o jsonpath='{.items[*].metadata.name}')
log "Service smoke/serve: $ip:80 -> pods $pods"

mode=$(ns "$STATE/bin/serve" -get http://127.0.0.1:10249/proxyMode) || fail "no proxy answers /proxyMode on the node"
[ "$mode" = userspace ] || fail "/proxyMode = $mode, want userspace (kube-portal-proxy)"
# The proxy refuses a Service until its endpoints are in and synced (as kube-proxy does), so wait
# for the first answer (kube-proxy's e2e allows 30 s of endpoint lag; 60 s here), then count.
wait_for "the proxy's rules for $ip" 60 sh -c "nsenter --net=/run/netns/$NS '$STATE/bin/serve' -get http://127.0.0.1:10249/debug/rules | grep -qF -- '$ip'" ||
  fail "kube-portal-proxy's /debug/rules never named $ip"
wait_for "the first answer of $ip:80 from the node" 60 ns "$STATE/bin/serve" -get "http://$ip/" ||
  fail "$ip:80 never answered from the node"

# check FROM N CMD...: runs CMD N times; every run must answer with a serve pod's name, and both
# pods must answer.
check() {
  local from=$1 n=$2 seen="" out i
  shift 2
  for ((i = 0; i < n; i++)); do
    out=$("$@" 2>&1) || fail "from $from: request $i to $ip:80 failed: $out"
    case " $pods " in *" $out "*) ;; *) fail "from $from: answer '$out' is not a serve pod" ;; esac
    case " $seen " in *" $out "*) ;; *) seen="$seen $out" ;; esac
  done
  [ "$(wc -w <<<"$seen")" = 2 ] || fail "from $from: $n requests reached only$seen"
  log "ok: from $from, $n requests to $ip:80 answered by both pods:$seen"
}
check "the node" 20 ns "$STATE/bin/serve" -get "http://$ip/"
check "pod client" 20 kc -n smoke exec client -- /serve -get "http://$ip/"
nodes=$(node_count)
if ((nodes > 1)); then
  log "serve pods on nodes: $(kc -n smoke get pods -l app=serve -o jsonpath='{.items[*].spec.nodeName}'); client on $(kc -n smoke get pod client -o jsonpath='{.spec.nodeName}')"
  for ((i = 1; i < nodes; i++)); do
    mode=$(node_exec "$i" "$STATE/bin/serve" -get http://127.0.0.1:10249/proxyMode) || fail "no proxy answers /proxyMode on $(node_name "$i")"
    [ "$mode" = userspace ] || fail "/proxyMode on $(node_name "$i") = $mode, want userspace (kube-portal-proxy)"
    wait_for "the first answer of $ip:80 from $(node_name "$i")" 60 node_exec "$i" "$STATE/bin/serve" -get "http://$ip/" ||
      fail "$ip:80 never answered from $(node_name "$i")"
    check "node $(node_name "$i")" 20 node_exec "$i" "$STATE/bin/serve" -get "http://$ip/"
  done
fi
log "PASS"
