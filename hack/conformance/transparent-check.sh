#!/usr/bin/env bash
# transparent-check.sh (root) measures, in network namespaces of its own that it deletes, whether
# a transparent source mode could pass the three upstream source-IP specs a userspace proxy fails
# (docs/cluster.md, "Conformance"): the proxy's socket to the endpoint gets IP_TRANSPARENT and is bound to
# the client's address, and policy routing on the node delivers the endpoint's replies to it.
# Not a feature of kube-portal-proxy: an experiment with python3 sockets standing in for the proxy.
#
#   node     10.244.0.1/24 on bridge br0 (the CNI's cni0), 10.99.0.2/24 towards rem; in it
#            mangle PREROUTING -m socket --transparent -j MARK, ip rule fwmark -> table 4000,
#            local 0.0.0.0/0 dev lo table 4000
#   cli, be  a client pod 10.244.0.10 and the endpoint pod 10.244.0.20 on br0
#   rem      another node, 10.99.0.3, routing 10.244.0.0/24 via the node
#
# The "proxy" in node dials the endpoint from a transparent socket bound to: 10.99.0.3 (a client
# on another node, as in the two externalTrafficPolicy=Local specs), 10.244.0.10 (a pod client on
# the endpoint's bridge, as in "should preserve source pod IP for traffic thru service cluster
# IP"), 10.244.0.1 (the node's address, what the proxy does today). Then again with a bridge
# rule that makes the node route, not bridge, IPv4 frames between pods (destination MAC set to
# br0's), and a direct pod-to-pod connection to show it still works. Each line says what source
# address the endpoint saw, or that the dial failed.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "transparent-check.sh needs root" >&2; exit 1; }
P=kpp-tpc
names="node cli be rem"
cleanup() { for n in $names; do ip netns del "$P-$n" 2>/dev/null || true; done; }
trap cleanup EXIT
cleanup
nsx() { local n=$1; shift; ip netns exec "$P-$n" "$@"; }

for n in $names; do ip netns add "$P-$n"; ip -n "$P-$n" link set lo up; done
ip -n "$P-node" link add br0 type bridge
ip -n "$P-node" addr add 10.244.0.1/24 dev br0
ip -n "$P-node" link set br0 up
for pod in cli:10.244.0.10 be:10.244.0.20; do
  n=${pod%%:*} addr=${pod#*:}
  ip -n "$P-node" link add "v$n" type veth peer name eth0 netns "$P-$n"
  ip -n "$P-node" link set "v$n" master br0 up
  ip -n "$P-$n" addr add "$addr/24" dev eth0
  ip -n "$P-$n" link set eth0 up
  ip -n "$P-$n" route add default via 10.244.0.1
done
ip -n "$P-node" link add vrem type veth peer name eth0 netns "$P-rem"
ip -n "$P-node" addr add 10.99.0.2/24 dev vrem
ip -n "$P-node" link set vrem up
ip -n "$P-rem" addr add 10.99.0.3/24 dev eth0
ip -n "$P-rem" link set eth0 up
ip -n "$P-rem" route add 10.244.0.0/24 via 10.99.0.2
nsx node sysctl -qw net.ipv4.ip_forward=1
nsx node iptables -t mangle -A PREROUTING -m socket --transparent -j MARK --set-xmark 0x4000/0x4000
ip -n "$P-node" rule add fwmark 0x4000/0x4000 lookup 4000
ip -n "$P-node" route add local 0.0.0.0/0 dev lo table 4000

# The endpoint answers each connection with the source address it sees (until the end, 60 s at most).
ip netns exec "$P-be" timeout 60 python3 -c '
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8080)); s.listen()
while True:
    c, a = s.accept(); c.sendall(("%s\n" % a[0]).encode()); c.close()
' &
endpoint=$!
nsx be bash -c 'for i in $(seq 100); do ss -ltn | grep -q ":8080 " && exit 0; sleep 0.1; done; exit 1'

# dial SOURCE: the node's transparent dial from SOURCE to the endpoint (3 s timeout).
dial() {
  nsx node python3 -c '
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_IP, 19, 1)  # IP_TRANSPARENT
s.bind((sys.argv[1], 0)); s.settimeout(3)
try:
    s.connect(("10.244.0.20", 8080)); print("  bound to %-12s endpoint saw %s" % (sys.argv[1], s.recv(64).decode().strip()))
except OSError as e:
    print("  bound to %-12s dial failed: %s" % (sys.argv[1], e))
' "$1"
}
echo "transparent dials, the node bridging between pods (the bridge CNI as it is):"
dial 10.99.0.3
dial 10.244.0.10
dial 10.244.0.1
echo "the same with the node routing IPv4 between its pods (bridge prerouting: destination MAC := br0's):"
nsx node sysctl -qw net.ipv4.conf.all.send_redirects=0 net.ipv4.conf.br0.send_redirects=0
nsx node nft add table bridge kpp-tpc
nsx node nft add chain bridge kpp-tpc pre '{ type filter hook prerouting priority -300; }'
nsx node nft add rule bridge kpp-tpc pre ether type ip ip daddr 10.244.0.0/24 \
  ether daddr set "$(nsx node cat /sys/class/net/br0/address)" meta pkttype set host
dial 10.99.0.3
dial 10.244.0.10
dial 10.244.0.1
nsx cli python3 -c '
import socket
s = socket.create_connection(("10.244.0.20", 8080), 3)
print("  pod to pod, direct:        endpoint saw %s" % s.recv(64).decode().strip())
'
kill "$endpoint" 2>/dev/null || true
wait "$endpoint" 2>/dev/null || true
