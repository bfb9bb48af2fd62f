#!/usr/bin/env bash
# build.sh builds, once per Kubernetes version, what make conformance runs into the cache:
#
#   ${KPP_CACHE:-$HOME/.cache/kube-portal-proxy}/bin/e2e-<kube version>.test   (sig-network specs)
#   ${KPP_CACHE:-$HOME/.cache/kube-portal-proxy}/bin/agnhost-<agnhost version> (static)
#   ${KPP_CACHE:-$HOME/.cache/kube-portal-proxy}/bin/ginkgo-<kube version>     (the ginkgo CLI of
#       the version e2e.test links, which runs it in parallel processes)
#   ${KPP_CACHE:-$HOME/.cache/kube-portal-proxy}/bin/regression-issue-74839-<kube version> (static;
#       the boom-server of the Conntrack invalid-state spec, test/images/regression-issue-74839)
#
# e2e.test is `go test -c` of hack/conformance/e2e (a TestMain of ours around the upstream
# entry point, blank-importing k8s.io/kubernetes/test/e2e/network), compiled in a copy of that
# folder whose go.mod requires k8s.io/kubernetes and replaces every staging module by its
# published v0.<minor>.<patch>, as hack/cluster/build.sh does (hack/lib/kube-build.sh). agnhost (the test image's
# binary), the ginkgo CLI and regression-issue-74839 are built in the same module. It prints
# KPP_E2E_TEST=path, KPP_AGNHOST=path, KPP_GINKGO=path and KPP_REGRESSION_74839=path.
#
# Environment: KPP_CACHE, KPP_KUBE_VERSION (default v1.36.3), KPP_KEEP_GOCACHE=1 keeps the
# private build cache, KPP_GOCACHE a
# build cache shared with the other builds of k8s.io/kubernetes (kept; see controlplane-build.sh).
set -euo pipefail
# The cache layout, log and die, the build environment; build_kubernetes and its steps.
# shellcheck source=hack/lib/kube-build.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib/kube-build.sh"
kube_build_init conformance-build

here=$(cd "$(dirname "$0")" && pwd)
kube_version=${KPP_KUBE_VERSION:-v1.36.3}
# The agnhost tag test/utils/image/manifest.go of that version names.
agnhost_version=${KPP_AGNHOST_VERSION:-2.63.0}
# The ginkgo CLI runs a compiled suite only when its name ends in .test.
e2e=$bin_dir/e2e-$kube_version.test
agnhost=$bin_dir/agnhost-$agnhost_version
ginkgo=$bin_dir/ginkgo-$kube_version
regression=$bin_dir/regression-issue-74839-$kube_version

# build is build_kubernetes's sequence around a copied module (e2e.test is a test binary of ours,
# not a main package of k8s.io/kubernetes) whose test tools are built without version stamps.
build() {
  local dir=$work_dir/e2e-$kube_version
  log "building e2e.test $kube_version and agnhost $agnhost_version (~10 min cold on 2 cores)"
  rm -rf "$dir"
  mkdir -p "$dir"
  cp "$here/e2e/go.mod" "$here/e2e/e2e_test.go" "$dir/"
  kube_module_require "$dir" -tool=k8s.io/kubernetes/test/images/agnhost \
    -tool=github.com/onsi/ginkgo/v2/ginkgo -tool=k8s.io/kubernetes/test/images/regression-issue-74839
  if [ ! -x "$e2e" ]; then
    (cd "$dir" && CGO_ENABLED=0 go test -c -trimpath -ldflags "$(kube_ldflags)" -o "$e2e.tmp" .)
    mv -f "$e2e.tmp" "$e2e"
  fi
  [ -x "$agnhost" ] || kube_install "$dir" "-s -w" "$agnhost" k8s.io/kubernetes/test/images/agnhost
  [ -x "$ginkgo" ] || kube_install "$dir" "-s -w" "$ginkgo" github.com/onsi/ginkgo/v2/ginkgo
  [ -x "$regression" ] || kube_install "$dir" "-s -w" "$regression" k8s.io/kubernetes/test/images/regression-issue-74839
  rm -rf "$dir"
}

main() {
  build_cache_open .lock-e2e gocache-e2e
  if [ ! -x "$e2e" ] || [ ! -x "$agnhost" ] || [ ! -x "$ginkgo" ] || [ ! -x "$regression" ]; then
    command -v go >/dev/null 2>&1 || die "go not found in PATH (need Go >= 1.26)"
    build
    build_cache_close
  fi
  printf 'KPP_E2E_TEST=%s\nKPP_AGNHOST=%s\nKPP_GINKGO=%s\nKPP_REGRESSION_74839=%s\n' "$e2e" "$agnhost" "$ginkgo" "$regression"
}

main "$@"
