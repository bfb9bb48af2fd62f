# kube-build.sh: sourced by the scripts that build Kubernetes components from the Go module proxy
# (controlplane-build.sh, kubeproxy-build.sh, legacy-build.sh, cluster/build.sh,
# conformance/build.sh). Each calls kube_build_init first and sets kube_version before building.
#
# Why a throwaway module: `go install pkg@version` refuses k8s.io/kubernetes (its go.mod carries
# replace directives), and importing it into this project's go.mod would drag in its staging
# replaces and link a 100 MB server into test binaries. So each component is built from a tiny
# module under the cache dir that requires k8s.io/kubernetes and replaces every staging module
# (k8s.io/api, k8s.io/apimachinery, ...) by its published v0.<minor>.<patch>.
#
# build_kubernetes does the whole sequence; the steps (kube_module_new, kube_module_require,
# kube_ldflags, kube_install) are there for the builds that need something in between (a copied
# go.mod, a patched vendor tree, an older toolchain).

# kube_build_init NAME [TOOLCHAIN] starts a build script: log and die prefix their messages with
# NAME; cache (KPP_CACHE, default ~/.cache/kube-portal-proxy), bin_dir (its bin/, where the
# binaries go, named with their versions) and work_dir (its build/: throwaway modules, locks,
# private build caches) are the layout every build shares; kube_build_env with TOOLCHAIN.
kube_build_init() {
  build_name=$1
  cache=${KPP_CACHE:-${HOME:?HOME or KPP_CACHE must be set}/.cache/kube-portal-proxy}
  bin_dir=$cache/bin
  work_dir=$cache/build
  kube_build_env "${2:-local}"
}

log() { printf '%s: %s\n' "$build_name" "$*" >&2; }
die() { log "$*"; exit 1; }

# kube_build_env sets what every build here runs under: not influenced by the caller's module
# setup (a go.work, -mod=vendor, VCS stamping, a cross-compile target), and failing clearly rather
# than downloading a toolchain behind the user's back ($1, default local, names one on purpose).
kube_build_env() {
  export GOWORK=off GOFLAGS=-buildvcs=false GOTOOLCHAIN=${1:-local}
  unset GOOS GOARCH
}

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

# kube_module_new DIR NAME creates a fresh, empty throwaway module NAME in DIR.
kube_module_new() {
  rm -rf "$1"
  mkdir -p "$1"
  (cd "$1" && go mod init "$2" >/dev/null 2>&1)
}

# kube_module_require [--pin FUNC] DIR [EDIT...] makes the module in DIR require
# k8s.io/kubernetes@$kube_version with every staging module replaced by its release, applies the
# further `go mod edit` flags EDIT (-tool=k8s.io/kubernetes/cmd/kubectl, say) and tidies it.
# With --pin, FUNC MODULE VERSION, run in DIR, prints the version to use instead (a release the
# proxy serves).
kube_module_require() {
  local pin=
  if [ "${1:-}" = --pin ]; then
    pin=$2
    shift 2
  fi
  local dir=$1
  shift
  local replaces=() mod ver use
  while read -r mod ver; do
    use=$ver
    if [ -n "$pin" ]; then
      use=$(cd "$dir" && "$pin" "$mod" "$ver")
      [ "$use" = "$ver" ] || log "$mod@$ver is not served by the module proxy; using $use"
    fi
    replaces+=("-replace=$mod=$mod@$use")
  done < <(cd "$dir" && staging_replaces)
  log "replacing ${#replaces[@]} staging modules by their v0.${kube_version#v1.} releases"
  (
    cd "$dir"
    go mod edit "${replaces[@]}" -require="k8s.io/kubernetes@$kube_version" "$@"
    go mod tidy
  )
}

# kube_ldflags prints the -ldflags of a release build of $kube_version: stripped, and stamped with
# the version as Kubernetes' own build stamps it (kubectl reports its client version from
# client-go, the servers theirs from component-base).
kube_ldflags() {
  local minor=${kube_version#v1.}
  minor=${minor%%.*}
  local ldflags="-s -w" pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  printf '%s\n' "$ldflags"
}

# kube_install DIR LDFLAGS OUT PKG [BUILDFLAG...] builds the main package PKG in the module in DIR,
# statically, into OUT. It writes OUT.tmp first: an interrupted build leaves no binary at OUT that
# the next run would take as built.
kube_install() {
  local dir=$1 ldflags=$2 out=$3 pkg=$4
  shift 4
  (cd "$dir" && CGO_ENABLED=0 go build "$@" -trimpath -ldflags "$ldflags" -o "$out.tmp" "$pkg")
  mv -f "$out.tmp" "$out"
}

# build_kubernetes NAME PKG=OUT... builds main packages of k8s.io/kubernetes@$kube_version (PKG,
# k8s.io/kubernetes/cmd/kubectl say) into OUT from a throwaway module kpp.invalid/NAME under
# $work_dir. One `go build` of them all: they share most of their packages, compiled once. (PKG
# first: a package path holds no "=", a file path may.)
build_kubernetes() {
  local name=$1
  shift
  local dir=$work_dir/${name##*/}-$kube_version
  local spec pkgs=() tools=()
  for spec in "$@"; do
    pkgs+=("${spec%%=*}")
    tools+=("-tool=${spec%%=*}")
  done
  kube_module_new "$dir" "kpp.invalid/$name"
  kube_module_require "$dir" "${tools[@]}"
  mkdir -p "$dir/out"
  (cd "$dir" && CGO_ENABLED=0 go build -trimpath -ldflags "$(kube_ldflags)" -o out/ "${pkgs[@]}")
  for spec in "$@"; do
    mv -f "$dir/out/$(basename "${spec%%=*}")" "${spec#*=}"
  done
  rm -rf "$dir"
}

# build_cache_open LOCK GOCACHE makes $bin_dir and $work_dir, holds the lock file $work_dir/LOCK
# (fd 9) for the rest of the script - two concurrent runs, two test jobs on one machine, would
# race on the same throwaway modules - and sets GOCACHE: $KPP_GOCACHE when set (a cache shared
# by the builds of k8s.io/kubernetes, kept), else the private $work_dir/GOCACHE, which
# build_cache_close removes unless KPP_KEEP_GOCACHE=1 (the k8s build leaves ~2.5 GB in it).
build_cache_open() {
  mkdir -p "$bin_dir" "$work_dir"
  exec 9>"$work_dir/$1"
  if command -v flock >/dev/null 2>&1; then
    flock 9
  fi
  export GOCACHE=${KPP_GOCACHE:-$work_dir/$2}
}

build_cache_close() {
  if [ "${KPP_KEEP_GOCACHE:-}" != 1 ] && [ -z "${KPP_GOCACHE:-}" ]; then
    go clean -cache >/dev/null 2>&1 || true
    rm -rf "$GOCACHE"
  fi
}
