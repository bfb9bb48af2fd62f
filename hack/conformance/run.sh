#!/usr/bin/env bash
# run.sh runs the upstream sig-network e2e specs (e2e.test, built by build.sh) against the make
# cluster cluster (make conformance, make conformance-ci): brings the cluster up when it is not,
# imports the e2e test images (images.sh) into its containerd, runs e2e.test inside the cluster's
# network namespace, and writes the JUnit report, the log and summary.md to OUT_DIR.
#
#   run.sh OUT_DIR           the full selection: FOCUS below, minus skips.txt
#   CONFORMANCE_FOCUS=ci     the CI subset (ci-focus.txt; on several nodes ci-focus-nodes.txt),
#                            minus skips.txt
#   CONFORMANCE_FOCUS=RE     any other -ginkgo.focus
#
# On a cluster of more than one node (make conformance NODES=3) the [Disruptive] specs run too:
# after the others, in a second pass of their own with one process (they restart the service
# proxy or the API server, which specs running next to them would see fail), and summary.md
# merges both reports.
#
# Exit status: e2e.test's (non-zero when a spec failed). The cluster stays up (make cluster-down).
# Environment: IMAGE, IMAGE_OCI (for make cluster), CONFORMANCE_FOCUS, CONFORMANCE_TIMEOUT
# (ginkgo's suite timeout, default 3h), CONFORMANCE_PROCS (parallel ginkgo processes, default 1).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source=../cluster/common.sh
. "$repo/hack/cluster/common.sh"
out=${1:?usage: run.sh OUT_DIR}
[ "$(id -u)" = 0 ] || die "make conformance needs root (the cluster's network namespace)"

# Everything the sig-network Services suites hold that can run on one node: the Services specs,
# the Services granular checks, EndpointSlice (and its mirroring), KubeProxy and Conntrack.
FOCUS='\[sig-network\] (Services |Networking Granular Checks: Services |EndpointSlice|KubeProxy |Conntrack )'
joined() { grep -v '^#' "$1" | grep -v '^[[:space:]]*$' | cut -f1 | paste -sd'|'; }
skip=$(joined "$here/skips.txt")
skips_file=$here/skips.txt

eval "$("$repo/hack/controlplane-build.sh")"
eval "$("$here/build.sh")"
if [ ! -e "/run/netns/$NS" ]; then
  log "no cluster: starting one (make cluster)"
  "$repo/hack/cluster/up.sh"
fi

nodes=$(node_count)
case ${CONFORMANCE_FOCUS:-} in
"") focus=$FOCUS ;;
# The CI subset: the one-node list, or on several nodes the multi-node one.
ci) if ((nodes > 1)); then focus=$(joined "$here/ci-focus-nodes.txt"); else focus=$(joined "$here/ci-focus.txt"); fi ;;
*) focus=$CONFORMANCE_FOCUS ;;
esac
mkdir -p "$out"
rm -rf "$out"/junit_*.xml "$out/summary.md" "$out/disruptive"
images_started=$SECONDS
"$here/images.sh" "$KPP_AGNHOST" "$KPP_REGRESSION_74839" "$STATE/images/e2e"
# Into every node's containerd, the nodes in parallel (0.7 GB of tarballs each).
imports=()
for ((i = 0; i < nodes; i++)); do
  (for img in "$STATE"/images/e2e/*.tar; do
    ctr -a "$(node_sock "$i")" -n k8s.io images import "$img" >/dev/null
  done) &
  imports+=($!)
done
for pid in "${imports[@]}"; do wait "$pid" || die "importing the e2e images into a node's containerd failed"; done
log "e2e images built and imported into $nodes node(s) in $((SECONDS - images_started))s"
# Several nodes: the [Disruptive] line leaves skips.txt (the second pass runs those specs).
skip2=""
if ((nodes > 1)); then
  grep -v '^\\\[Disruptive\\\]' "$here/skips.txt" >"$out/skips.txt"
  skips_file=$out/skips.txt
  skip2=$(joined "$skips_file")
  skip="$skip2|\[Disruptive\]"
fi

# e2e.test's -report-dir gets junit_01.xml; the framework checks kube-system's pods are Running
# and the node Ready before the first spec.
args=(--kubeconfig="$KUBECONFIG_ADMIN" --kubectl-path="$KPP_KUBECTL" --provider=skeleton --num-nodes="$nodes"
  --report-dir="$out" --e2e-output-dir="$out" --dump-logs-on-failure=false)
ginkgo_args=(--focus="$focus" --skip="$skip" --timeout="${CONFORMANCE_TIMEOUT:-3h}" --no-color --v)
procs=${CONFORMANCE_PROCS:-1}
log "e2e.test $(basename "$KPP_E2E_TEST") in $procs process(es): focus $focus"
log "skip $skip"
started=$SECONDS
status=0
if [ "$procs" -gt 1 ]; then
  # The ginkgo CLI runs the compiled suite in parallel processes ([Serial] specs last, alone),
  # as kube-proxy's kind jobs do.
  ns "$KPP_GINKGO" --procs="$procs" "${ginkgo_args[@]}" "$KPP_E2E_TEST" -- "${args[@]}" >"$out/e2e.log" 2>&1 || status=$?
else
  ns "$KPP_E2E_TEST" "${args[@]}" "${ginkgo_args[@]/#--/--ginkgo.}" >"$out/e2e.log" 2>&1 || status=$?
fi
log "e2e.test exited $status after $((SECONDS - started))s (log $out/e2e.log)"
junits=$(ls "$out"/junit_*.xml 2>/dev/null | head -1)

if [ -n "$skip2" ] && [ -n "$junits" ]; then
  mkdir -p "$out/disruptive"
  log "second pass: the [Disruptive] specs, one process"
  t0=$SECONDS
  s2=0
  ns "$KPP_E2E_TEST" "${args[@]/#--report-dir=*/--report-dir=$out/disruptive}" --ginkgo.focus="$focus" \
    --ginkgo.skip="$skip2" --ginkgo.label-filter=Disruptive --ginkgo.timeout="${CONFORMANCE_TIMEOUT:-3h}" \
    --ginkgo.no-color --ginkgo.v >"$out/disruptive/e2e.log" 2>&1 || s2=$?
  log "e2e.test (Disruptive) exited $s2 after $((SECONDS - t0))s (log $out/disruptive/e2e.log)"
  [ "$status" != 0 ] || status=$s2
  d=$(ls "$out"/disruptive/junit_*.xml 2>/dev/null | head -1)
  [ -z "$d" ] || junits="$junits,$d"
fi

if [ -n "$junits" ]; then
  (cd "$repo" && go run ./hack/conformance/summary -junit "$junits" \
    -skips "$skips_file" -focus "$focus" -o "$out/summary.md")
  sed -n 3p "$out/summary.md" >&2
  log "summary: $out/summary.md"
else
  log "no JUnit report in $out; see $out/e2e.log"
  [ "$status" != 0 ] || status=1
fi
exit "$status"
