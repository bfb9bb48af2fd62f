#!/usr/bin/env bash
# rollout.sh proves on a running make cluster (make cluster-rollout) that a rolling update of the
# kube-portal-proxy DaemonSet refuses no connection (docs/restarts.md): a client
# pod opens a new connection every 20 ms to a Service's cluster IP and, in parallel, to its node
# port (two serve pods behind it) for the whole update; then
#   kubectl -n kube-system rollout restart daemonset/kube-portal-proxy
# With maxSurge 1 / maxUnavailable 0 the new pod starts next to the old one, takes its listening
# sockets over --handover-socket, and the old one is deleted once the new one is Ready. Asserts:
# two proxy pods ran at once on the node, the new pod's log says "Took over from the running
# proxy" and its kube_portal_proxy_restart_sockets{origin="inherited"} > 0, the old pod's log says
# it handed over (it was not deleted before the new one had taken over), the client saw zero
# failures through either address, and the Service answers from both pods afterwards. Prints
# the counts. Leaves nothing behind (the rollout namespace is deleted; the DaemonSet stays
# updated, as a user's would).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=common.sh
. "$here/common.sh"
need_cluster cluster-rollout

PROXY_LABEL=app.kubernetes.io/name=kube-portal-proxy
work=$(mktemp -d)
watcher=""
oldlog=""
client_ip=""
fail() {
  log "FAIL: $*"
  [ -z "$client_ip" ] || ns "$STATE/bin/serve" -get "http://$client_ip:8080/stats" 2>&1 | sed 's/^/cluster:   client: /' >&2 || true
  [ ! -s "$work/old.log" ] || tail -5 "$work/old.log" | sed 's/^/cluster:   old pod: /' >&2
  exit 1
}
cleanup() {
  [ -z "$watcher" ] || kill "$watcher" 2>/dev/null || true
  [ -z "$oldlog" ] || kill "$oldlog" 2>/dev/null || true
  kc delete namespace rollout --wait=false >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

# proxy_pods prints the kube-portal-proxy pods: name, phase, deleting or not, one per line.
proxy_pods() {
  kc -n kube-system get pods -l "$PROXY_LABEL" \
    -o jsonpath='{range .items[*]}{.metadata.name} {.status.phase} {.metadata.deletionTimestamp}{"\n"}{end}'
}

kc -n kube-system rollout status daemonset/kube-portal-proxy --timeout=60s >/dev/null ||
  fail "the kube-portal-proxy DaemonSet is not ready before the rollout"
old=$(proxy_pods | awk '{print $1}')
[ "$(wc -w <<<"$old")" = 1 ] || fail "want one kube-portal-proxy pod before the rollout, have: $old"

# A previous run's namespace may still be terminating (cleanup does not wait).
kc delete namespace rollout --ignore-not-found --wait=true --timeout=60s >/dev/null ||
  fail "the rollout namespace of a previous run is still there"
kc create namespace rollout >/dev/null || fail "cannot create the rollout namespace"
{ serve_deployment; echo ---; cat <<YAML; } | kc -n rollout apply -f - >/dev/null
apiVersion: v1
kind: Service
metadata: {name: serve}
spec:
  type: NodePort
  selector: {app: serve}
  ports: [{port: 80, targetPort: 8080}]
YAML
kc -n rollout rollout status deployment/serve --timeout=120s >/dev/null || fail "serve pods not ready"
ip=$(kc -n rollout get service serve -o jsonpath='{.spec.clusterIP}')
nodeport=$(kc -n rollout get service serve -o jsonpath='{.spec.ports[0].nodePort}')
pods=$(kc -n rollout get pods -l app=serve -o jsonpath='{.items[*].metadata.name}')
cluster_url=http://$ip/
node_url=http://$NODE_IP:$nodeport/
# The client starts only once both addresses answer, so every failure it counts is the proxy's.
wait_for "the first answer of $cluster_url from the node" 60 ns "$STATE/bin/serve" -get "$cluster_url" ||
  fail "$cluster_url never answered"
wait_for "the first answer of $node_url from the node" 60 ns "$STATE/bin/serve" -get "$node_url" ||
  fail "$node_url never answered"
log "Service rollout/serve: $cluster_url and $node_url -> pods $pods"

# The client: -probe-for bounds the load even if this script dies.
kc -n rollout apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Pod
metadata: {name: client}
spec:
  containers:
  - name: client
    image: $SERVE_IMAGE
    imagePullPolicy: Never
    args: [-listen, ":8080", -probe, "$cluster_url", -probe, "$node_url", -probe-every, 20ms, -timeout, 5s, -probe-for, 5m]
    readinessProbe: {httpGet: {path: /, port: 8080}, periodSeconds: 1}
YAML
kc -n rollout wait --for=condition=Ready pod/client --timeout=120s >/dev/null || fail "client pod not ready"
client_ip=$(kc -n rollout get pod client -o jsonpath='{.status.podIP}')
stats() { ns "$STATE/bin/serve" -get "http://$client_ip:8080/${1:-stats}" -timeout 30s; }
# answered N: each of the client's probes has at least N answers.
answered() { stats | awk -v n="$1" '{sub(/.* ok=/, ""); sub(/ .*/, "")} $0 + 0 < n + 0 {low = 1} END {exit NR != 2 || low}'; }
wait_for "the client's first 25 answers through both addresses" 30 answered 25 ||
  fail "the client does not get answers: $(stats)"
log "client pod connecting every 20 ms to $cluster_url and $node_url"

# Watch the proxy pods through the update (two at once is the surge pod next to the old one),
# and keep the old pod's log, which goes with the pod.
(
  deadline=$((SECONDS + 240))
  while ((SECONDS < deadline)); do
    echo "@ $(date +%T.%N | cut -c1-12)"
    proxy_pods || true
    sleep 0.5
  done
) >"$work/pods" 2>/dev/null &
watcher=$!
kc -n kube-system logs -f "$old" >"$work/old.log" 2>&1 &
oldlog=$!

t0=$SECONDS
kc -n kube-system rollout restart daemonset/kube-portal-proxy >/dev/null
kc -n kube-system rollout status daemonset/kube-portal-proxy --timeout=180s >/dev/null ||
  fail "rollout not done in 180s: $(proxy_pods | tr '\n' ' ')"
rolled=$((SECONDS - t0))
gone() { ! kc -n kube-system get pod "$1" >/dev/null 2>&1; }
wait_for "the old pod $old to be gone" 60 gone "$old" ||
  fail "the old pod $old is still there 60s after the rollout"
gone=$((SECONDS - t0))
new=$(proxy_pods | awk '{print $1}')
[ "$(wc -w <<<"$new")" = 1 ] && [ "$new" != "$old" ] || fail "want one new kube-portal-proxy pod after the rollout, have: $new"
# The load goes on a little after the old process is gone: at least 50 more answers each.
most=$(stats | sed -n 's/.* ok=\([0-9]*\) .*/\1/p' | sort -n | tail -1)
wait_for "50 more answers after the old pod went" 30 answered $((most + 50)) ||
  fail "the client gets no answers after the rollout: $(stats)"
final=$(stats stop)
kill "$watcher" 2>/dev/null || true
watcher=""
log "rollout: $old -> $new, rollout status done after ${rolled}s, old pod gone after ${gone}s"

# Two proxy pods Running at the same time: the surge pod was scheduled next to the old one.
overlap=$(awk '/^@/ {if (n >= 2) c++; n = 0; next} $2 == "Running" {n++} END {if (n >= 2) c++; print c + 0}' "$work/pods")
[ "$overlap" -gt 0 ] || fail "never saw two kube-portal-proxy pods Running at once: $(grep -v '^@' "$work/pods" | sort -u | tr '\n' ' ')"
log "ok: the surge pod ran next to the old one (two proxy pods Running in $overlap samples, 0.5 s apart)"

took=$(kc -n kube-system logs "$new" 2>&1 | grep -F 'Took over from the running proxy' || true)
[ -n "$took" ] || fail "the new pod's log does not say 'Took over from the running proxy': $(kc -n kube-system logs "$new" 2>&1 | tail -20)"
log "ok: new pod: $(sed -e 's/^.*msg=//' <<<"$took")"
inherited=$(ns "$STATE/bin/serve" -get http://127.0.0.1:10249/metrics |
  sed -n 's/^kube_portal_proxy_restart_sockets{origin="inherited"} \([0-9.e+]*\)$/\1/p')
[ -n "$inherited" ] && awk -v n="$inherited" 'BEGIN {exit !(n > 0)}' ||
  fail "kube_portal_proxy_restart_sockets{origin=\"inherited\"} = '${inherited}', want > 0"
log "ok: kube_portal_proxy_restart_sockets{origin=\"inherited\"} $inherited"
# The old process stopped because it handed over, not because its pod was deleted first.
grep -qF 'Handed over to a successor' "$work/old.log" ||
  fail "the old pod's log does not say it handed over to a successor (deleted before the new pod took over?)"
grep -E 'Handed over to a successor|Shutting down' "$work/old.log" | sed -e 's/^.*msg=/cluster:   old pod: /' >&2 || true

# The client's counts: zero failures, both pods answering through both addresses.
sed 's/^/cluster:   client: /' <<<"$final" >&2
failed=$(sed -n 's/.* failed=\([0-9]*\) .*/\1/p' <<<"$final" | awk '{n += $1} END {print n + 0}')
total=$(sed -n 's/.* ok=\([0-9]*\) .*/\1/p' <<<"$final" | awk '{n += $1} END {print n + 0}')
[ "$(wc -l <<<"$final")" = 2 ] || fail "want the client's counts for 2 addresses, have: $final"
[ "$failed" = 0 ] || fail "the client saw $failed failed connections of $((total + failed)) during the rollout"
for p in $pods; do
  [ "$(grep -c " answers=.*$p:" <<<"$final")" = 2 ] || fail "pod $p did not answer through both addresses"
done
log "ok: the client saw 0 failed connections of $total (every 20 ms through $cluster_url and $node_url, from before the rollout to after the old pod went)"

# And the new DaemonSet pod serves: from the node, both pods answer.
seen=""
for ((i = 0; i < 20; i++)); do
  out=$(ns "$STATE/bin/serve" -get "$cluster_url" 2>&1) || fail "after the rollout, request $i to $cluster_url: $out"
  case " $seen " in *" $out "*) ;; *) seen="$seen $out" ;; esac
done
[ "$(wc -w <<<"$seen")" = 2 ] || fail "after the rollout, 20 requests reached only$seen"
log "ok: after the rollout, $cluster_url answered 20 requests from the node by both pods:$seen"
log "PASS"
