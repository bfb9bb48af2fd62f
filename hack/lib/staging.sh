# staging.sh: sourced by the scripts that build Kubernetes components from the Go module proxy
# (controlplane-build.sh, cluster/build.sh, conformance/build.sh, legacy-build.sh). Each of them
# defines die and kube_version before calling.

# staging_replaces prints "module version" for every module k8s.io/kubernetes@$kube_version's own
# go.mod replaces with a ./staging/ directory, paired with the published version of the same
# release (v1.X.Y -> v0.X.Y): what a throwaway module that requires k8s.io/kubernetes must replace.
staging_replaces() {
  local gomod staging_version=v0.${kube_version#v1.}
  gomod=$(go mod download -json "k8s.io/kubernetes@$kube_version" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
  [ -f "$gomod" ] || die "cannot locate go.mod of k8s.io/kubernetes@$kube_version"
  # A replace line looks like "k8s.io/api => ./staging/src/k8s.io/api" (inside or outside a block).
  awk -v ver="$staging_version" '
    { sub(/^replace[[:space:]]+/, "") }
    $2 == "=>" && $3 ~ /^\.\/staging\// { print $1, ver; n++ }
    END { if (n == 0) exit 1 }' "$gomod" ||
    die "no ./staging replace directives found in $gomod"
}
