#!/usr/bin/env bash
# install-deps.sh installs the system tools a group of tasks needs, when they are missing, on
# Debian/Ubuntu (apt-get). Used by `make demo`, `make deps`, the preflight of the targets run by
# hand (cluster, conformance, image-oci, bench, soak: see the Makefile) and .ci/run.
#
#   hack/install-deps.sh [--check] GROUP...
#
# Groups:
#   demo  iproute2 (ip: the throwaway namespaces), iptables (iptables, iptables-save,
#         iptables-restore: the proxy's portal rules)
#   test  the demo's, plus conntrack (the conntrack cleanup benchmark fills and lists the table
#         with it; the proxy itself clears entries over netlink), openssl, make, chromium and
#         nginx (nginx-light: the PROXY protocol tests run a real nginx with proxy_protocol),
#         socat (the transparent source mode's UDP backend answers with the peer it saw),
#         tshark (the capture tests read the pcapng files `observe --pcap` writes), and the
#         monitoring group's
#   monitoring  the chart and monitoring tests: prometheus and promtool (Debian's prometheus,
#         without its recommended node exporter), and helm, which Debian does not package: built
#         with `go install helm.sh/helm/v3/cmd/helm@HELM_VERSION` into /usr/local/bin (needs go)
#   cluster  make cluster and make conformance: containerd, runc, the CNI plugins (bridge,
#         host-local, loopback), nsenter/setsid (util-linux), iproute2, iptables, openssl, curl,
#         and the image group's
#   image  make image-oci: mmdebstrap (the image's Debian layer)
#   bench  make bench: the demo's, plus haproxy, nginx with its stream module
#         (nginx-light, libnginx-mod-stream), redis (redis-server, redis-tools: redis-benchmark),
#         dnsperf and unbound (the real clients and servers), and a C compiler (the ceiling)
#
# Nothing missing: exits 0 silently. Missing, as root with apt-get: installs them. Missing and
# not root, without apt-get, or with --check: prints the exact command to run and exits 1, at once.
# Works as root without sudo (containers) and under sudo.
set -euo pipefail

# helm is not in Debian: the Go module proxy builds it.
HELM_VERSION=v3.22.0

usage() {
  echo "usage: $0 [--check] demo|test|monitoring|cluster|image|bench..." >&2
  exit 2
}

# Each entry is command:package.
group_tools() {
  case "$1" in
    demo) echo "ip:iproute2 iptables:iptables iptables-save:iptables iptables-restore:iptables" ;;
    test) echo "$(group_tools demo) $(group_tools monitoring) conntrack:conntrack openssl:openssl make:make chromium:chromium nginx:nginx-light socat:socat tshark:tshark" ;;
    monitoring) echo "prometheus:prometheus promtool:prometheus helm:go:helm.sh/helm/v3/cmd/helm@$HELM_VERSION" ;;
    cluster) echo "$(group_tools demo) $(group_tools image) containerd:containerd containerd-shim-runc-v2:containerd ctr:containerd runc:runc /usr/lib/cni/bridge:containernetworking-plugins nsenter:util-linux setsid:util-linux unshare:util-linux openssl:openssl curl:curl" ;;
    image) echo "mmdebstrap:mmdebstrap" ;;
    bench) echo "$(group_tools demo) haproxy:haproxy nginx:nginx-light /usr/lib/nginx/modules/ngx_stream_module.so:libnginx-mod-stream redis-server:redis-server redis-benchmark:redis-tools dnsperf:dnsperf unbound:unbound cc:gcc" ;;
  esac
}

# have reports whether a command exists: an executable regular file on PATH. Debian leaves
# /usr/sbin and /sbin out of a normal user's PATH, where iptables, ip and conntrack live, so look
# there too. Not bash's `command -v`, which names a file it cannot execute when nothing on PATH
# is executable.
have() {
  case $1 in /*) [ -f "$1" ] && [ -x "$1" ]; return ;; esac
  local d IFS=:
  for d in $PATH /usr/sbin /sbin; do
    [ -n "$d" ] && [ -f "$d/$1" ] && [ -x "$d/$1" ] && return 0
  done
  return 1
}

check=0
groups=()
for a in "$@"; do
  case "$a" in
    --check) check=1 ;;
    -h|--help) usage ;;
    -*) usage ;;
    demo|test|monitoring|cluster|image|bench) groups+=("$a") ;;
    *) echo "$0: unknown group $a (want demo, test, monitoring, cluster, image or bench)" >&2; exit 2 ;;
  esac
done
[ ${#groups[@]} -gt 0 ] || usage

missing_cmds=()
missing_pkgs=()
missing_go=() # Go packages (module@version) built with go install
for g in "${groups[@]}"; do
  for entry in $(group_tools "$g"); do
    cmd=${entry%%:*} pkg=${entry#*:}
    have "$cmd" && continue
    case " ${missing_cmds[*]} " in *" $cmd "*) continue ;; esac
    missing_cmds+=("$cmd")
    case $pkg in
      go:*) missing_go+=("${pkg#go:}") ;;
      *) case " ${missing_pkgs[*]} " in *" $pkg "*) ;; *) missing_pkgs+=("$pkg") ;; esac ;;
    esac
  done
done
[ ${#missing_pkgs[@]} -eq 0 ] && [ ${#missing_go[@]} -eq 0 ] && exit 0

# go_install builds the missing Go tools into /usr/local/bin.
go_install() {
  [ ${#missing_go[@]} -eq 0 ] && return 0
  local go
  go=$(command -v go || echo /usr/local/go/bin/go)
  if [ ! -x "$go" ]; then
    echo "install-deps: go not found: cannot build ${missing_go[*]}" >&2
    return 1
  fi
  for m in "${missing_go[@]}"; do
    echo "install-deps: building $m with go install" >&2
    GOBIN=/usr/local/bin "$go" install "$m" >&2
  done
}

what="missing: ${missing_cmds[*]} (for ${groups[*]})"
install=""
if [ ${#missing_pkgs[@]} -gt 0 ]; then
  # Non-interactive: wireshark-common (tshark's) asks a debconf question; its default (only root
  # captures) is what we want.
  install="apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y ${missing_pkgs[*]}"
fi
for m in "${missing_go[@]}"; do
  install="${install:+$install && }GOBIN=/usr/local/bin go install $m"
done
if [ ${#missing_pkgs[@]} -eq 0 ]; then
  # Only Go tools: no apt-get needed, but /usr/local/bin is root's.
  if [ "$check" = 1 ] || [ "$(id -u)" != 0 ]; then
    echo "$what" >&2
    echo "Install them with: $install" >&2
    exit 1
  fi
  go_install
  echo "install-deps: installed ${missing_go[*]}" >&2
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "$what" >&2
  echo "No apt-get here: install the packages that provide them with your package manager (Debian/Ubuntu names: ${missing_pkgs[*]})." >&2
  exit 1
fi
if [ "$check" = 1 ] || [ "$(id -u)" != 0 ]; then
  echo "$what" >&2
  if [ "$(id -u)" = 0 ]; then
    echo "Install them with: $install" >&2
  else
    if command -v sudo >/dev/null 2>&1; then
      echo "Install them as root: sudo sh -c '$install'" >&2
    else
      echo "Install them as root (no sudo here: su, or a root shell): $install" >&2
    fi
  fi
  exit 1
fi

echo "install-deps: $what; installing ${missing_pkgs[*]} with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# The prometheus package without its recommends: they would pull in (and start) a node exporter.
plain=() norec=()
for p in "${missing_pkgs[@]}"; do
  case $p in prometheus) norec+=("$p") ;; *) plain+=("$p") ;; esac
done
[ ${#plain[@]} -eq 0 ] || apt-get install -y -qq "${plain[@]}" >/dev/null
[ ${#norec[@]} -eq 0 ] || apt-get install -y -qq --no-install-recommends "${norec[@]}" >/dev/null
go_install
still=()
for c in "${missing_cmds[@]}"; do have "$c" || still+=("$c"); done
if [ ${#still[@]} -gt 0 ]; then
  echo "install-deps: installed ${missing_pkgs[*]}, but still missing: ${still[*]}" >&2
  exit 1
fi
echo "install-deps: installed ${missing_pkgs[*]}" >&2
