package transparent

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
)

// Address plan (all inside namespaces the test creates; /work/notes/tp-exp.sh in Go):
//   node  br0 10.244.0.1/24 fd00:244::1/64 (the CNI's bridge); vrem 10.99.0.2/24 fd00:99::2/64
//   cli   a client pod on br0: 10.244.0.10 fd00:244::10
//   be    the endpoint pod on br0: 10.244.0.20 fd00:244::20, TCP and UDP echo of the peer's address on :8080
//   rem   another node: 10.99.0.3 fd00:99::3, routing the pod prefixes via the node
// The "proxy" is a socket in node with IP_TRANSPARENT bound to a client's address.

var (
	beV4  = netip.MustParseAddr("10.244.0.20")
	beV6  = netip.MustParseAddr("fd00:244::20")
	cliV4 = netip.MustParseAddr("10.244.0.10")
	cliV6 = netip.MustParseAddr("fd00:244::10")
	remV4 = netip.MustParseAddr("10.99.0.3")
	remV6 = netip.MustParseAddr("fd00:99::3")
)

type lab struct {
	node, cli, be, rem *netns.NS
}

func needTools(t testing.TB) {
	t.Helper()
	for _, bin := range []string{"nft", "ip", "bridge"} {
		if _, err := exec.LookPath(bin); err != nil {
			testenv.Unavailable(t, "%s not installed", bin)
		}
	}
}

func newLab(t testing.TB) *lab {
	t.Helper()
	needTools(t)
	l := netns.NewTestLab(t)
	lb := &lab{node: l.MustAdd(t, "node"), cli: l.MustAdd(t, "cli"), be: l.MustAdd(t, "be"), rem: l.MustAdd(t, "rem")}
	n := lb.node
	n.MustExec(t, "ip", "link", "add", "br0", "type", "bridge")
	n.MustExec(t, "ip", "addr", "add", "10.244.0.1/24", "dev", "br0")
	n.MustExec(t, "ip", "addr", "add", "fd00:244::1/64", "dev", "br0", "nodad")
	n.MustExec(t, "ip", "link", "set", "br0", "up")
	for _, p := range []struct {
		ns     *netns.NS
		v4, v6 netip.Addr
	}{{lb.cli, cliV4, cliV6}, {lb.be, beV4, beV6}} {
		port := "v" + strings.TrimPrefix(p.ns.Name, l.Prefix())
		n.MustExec(t, "ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", p.ns.Name)
		n.MustExec(t, "ip", "link", "set", port, "master", "br0", "up")
		p.ns.MustExec(t, "ip", "addr", "add", p.v4.String()+"/24", "dev", "eth0")
		p.ns.MustExec(t, "ip", "addr", "add", p.v6.String()+"/64", "dev", "eth0", "nodad")
		p.ns.MustExec(t, "ip", "link", "set", "eth0", "up")
		p.ns.MustExec(t, "ip", "route", "add", "default", "via", "10.244.0.1")
		p.ns.MustExec(t, "ip", "-6", "route", "add", "default", "via", "fd00:244::1")
	}
	if err := netns.Link(t.Context(), netns.End{NS: n, Dev: "vrem", Addr: netip.MustParsePrefix("10.99.0.2/24")},
		netns.End{NS: lb.rem, Dev: "eth0", Addr: netip.MustParsePrefix("10.99.0.3/24")}); err != nil {
		t.Fatal(err)
	}
	n.MustExec(t, "ip", "addr", "add", "fd00:99::2/64", "dev", "vrem", "nodad")
	lb.rem.MustExec(t, "ip", "addr", "add", "fd00:99::3/64", "dev", "eth0", "nodad")
	lb.rem.MustExec(t, "ip", "route", "add", "10.244.0.0/24", "via", "10.99.0.2")
	lb.rem.MustExec(t, "ip", "-6", "route", "add", "fd00:244::/64", "via", "fd00:99::2")
	n.MustExec(t, "sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1")
	if _, err := n.Exec(t.Context(), "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1", "net.bridge.bridge-nf-call-ip6tables=1"); err != nil {
		testenv.Unavailable(t, "br_netfilter not available: %v", err)
	}
	return lb
}

func (l *lab) newNode(t testing.TB) (*Node, *KernelNetlink) {
	nl := &KernelNetlink{Do: l.node.Do}
	t.Cleanup(func() { nl.Close() })
	return New(Config{Runner: &ExecRunner{iptables.ExecRunner{Prefix: l.node.CommandPrefix()}}, Netlink: nl}), nl
}

// serveEndpoint starts, in be, a TCP and a UDP server on :8080 (both families) that answer with
// the peer address they see.
func serveEndpoint(t *testing.T, be *netns.NS) {
	t.Helper()
	var ln net.Listener
	var pc net.PacketConn
	if err := be.Do(func() (err error) {
		if ln, err = net.Listen("tcp", ":8080"); err != nil {
			return err
		}
		pc, err = net.ListenPacket("udp", ":8080")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	testenv.ServeTCP(t, ln, func(c net.Conn) {
		fmt.Fprintf(c, "%s\n", c.RemoteAddr().(*net.TCPAddr).AddrPort().Addr().Unmap())
	})
	done := make(chan struct{})
	t.Cleanup(func() { pc.Close(); <-done })
	go func() {
		defer close(done)
		buf := make([]byte, 512)
		for {
			_, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo([]byte(from.(*net.UDPAddr).AddrPort().Addr().Unmap().String()), from)
		}
	}()
}

// transparentControl sets IP_TRANSPARENT (IPV6_TRANSPARENT) and SO_REUSEADDR before bind.
func transparentControl(network, _ string, c syscall.RawConn) error {
	var serr error
	err := c.Control(func(fd uintptr) {
		if strings.HasSuffix(network, "6") {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
		} else {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1)
		}
		if serr == nil {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
		}
	})
	return errors.Join(err, serr)
}

func netw(proto string, a netip.Addr) string {
	if a.Is6() {
		return proto + "6"
	}
	return proto + "4"
}

// dial connects from ns (a transparent socket bound to from when valid) to the endpoint and
// returns the address the endpoint saw.
func dial(ns *netns.NS, proto string, from, to netip.Addr, timeout time.Duration) (string, error) {
	var c net.Conn
	err := ns.Do(func() (err error) {
		d := net.Dialer{Timeout: timeout}
		if from.IsValid() {
			d.Control = transparentControl
			if proto == "tcp" {
				d.LocalAddr = &net.TCPAddr{IP: from.AsSlice()}
			} else {
				d.LocalAddr = &net.UDPAddr{IP: from.AsSlice()}
			}
		}
		c, err = d.Dial(netw(proto, to), netip.AddrPortFrom(to, 8080).String())
		return err
	})
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(timeout))
	if proto == "udp" {
		if _, err := c.Write([]byte("who")); err != nil {
			return "", err
		}
		buf := make([]byte, 512)
		n, err := c.Read(buf)
		return string(buf[:n]), err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

func mustSync(t *testing.T, n *Node) Support {
	t.Helper()
	sup, err := n.Sync(t.Context())
	if err != nil {
		t.Fatalf("Sync: %v", err)
	}
	return sup
}

// TestTransparentRepliesReachTheSocket is tp-exp.sh: the endpoint sees the address the proxy's
// transparent socket is bound to, for a client on another node and a pod on the endpoint's own
// bridge, TCP and UDP, both families; the bridged case fails without the bridge part; direct
// pod-to-pod traffic is still bridged.
func TestTransparentRepliesReachTheSocket(t *testing.T) {
	l := newLab(t)
	serveEndpoint(t, l.be)
	node, _ := l.newNode(t)
	sup := mustSync(t, node)
	if !sup.Socket || !sup.PolicyRouting || !sup.Bridge || sup.Reason != "" {
		t.Fatalf("Support = %+v, want all", sup)
	}
	for _, proto := range []string{"tcp", "udp"} {
		for _, c := range []struct {
			name     string
			from, to netip.Addr
		}{
			{"remote_node_v4", remV4, beV4}, {"same_bridge_v4", cliV4, beV4},
			{"remote_node_v6", remV6, beV6}, {"same_bridge_v6", cliV6, beV6},
		} {
			t.Run(proto+"/"+c.name, func(t *testing.T) {
				got, err := dial(l.node, proto, c.from, c.to, 5*time.Second)
				if err != nil || got != c.from.String() {
					t.Errorf("endpoint saw %q (%v), want %s", got, err, c.from)
				}
			})
		}
		t.Run(proto+"/pod_to_pod_direct", func(t *testing.T) {
			for _, to := range []netip.Addr{beV4, beV6} {
				want := cliV4
				if to.Is6() {
					want = cliV6
				}
				if got, err := dial(l.cli, proto, netip.Addr{}, to, 3*time.Second); err != nil || got != want.String() {
					t.Errorf("pod to pod %s: endpoint saw %q (%v), want %s", to, got, err, want)
				}
			}
		})
	}
	t.Run("same_bridge_fails_without_the_bridge_part", func(t *testing.T) {
		l.node.MustExec(t, "nft", "delete", "table", "bridge", NFTTable)
		for _, from := range []netip.Addr{cliV4, cliV6} {
			to := beV4
			if from.Is6() {
				to = beV6
			}
			if got, err := dial(l.node, "tcp", from, to, time.Second); err == nil {
				t.Errorf("bridged reply reached the socket without the bridge part (endpoint saw %q)", got)
			}
		}
		// And the next Sync puts it back.
		mustSync(t, node)
		if got, err := dial(l.node, "tcp", cliV4, beV4, 3*time.Second); err != nil || got != cliV4.String() {
			t.Errorf("after Sync: endpoint saw %q (%v), want %s", got, err, cliV4)
		}
	})
}

// snapshot is what the plumbing could touch in the node's namespace, without what changes by
// itself while the lab runs: counters (nft -s), IPv6 link-local and multicast routes and fdb
// entries (added when the kernel finishes address setup), learned fdb entries.
func snapshot(t *testing.T, ns *netns.NS) string {
	t.Helper()
	var b strings.Builder
	for _, argv := range [][]string{
		{"ip", "-4", "rule"}, {"ip", "-6", "rule"}, {"ip", "-4", "route", "show", "table", "all"},
		{"ip", "-6", "route", "show", "table", "all"}, {"nft", "-s", "list", "ruleset"}, {"bridge", "fdb", "show"},
	} {
		fmt.Fprintf(&b, "## %s\n", strings.Join(argv, " "))
		lines := strings.Split(ns.MustExec(t, argv...), "\n")
		if argv[0] == "nft" {
			slices.Sort(lines) // iptables-nft may list a table's chains in another order after a change
		}
		for _, line := range lines {
			switch {
			case strings.HasPrefix(line, "# "), strings.Contains(line, "fe80:"), strings.Contains(line, "ff00::/8"),
				argv[0] == "bridge" && (strings.HasPrefix(line, "33:33:") || !strings.Contains(line, "permanent")):
				continue
			}
			b.WriteString(line + "\n")
		}
	}
	return b.String()
}

// TestCleanupLeavesNothing: the namespace after Sync and Cleanup is as it was before, an earlier
// build's iptables mangle chain (and its jumps) removed too.
func TestCleanupLeavesNothing(t *testing.T) {
	l := newLab(t)
	for _, bin := range []string{"iptables", "ip6tables"} {
		if _, err := exec.LookPath(bin); err != nil {
			testenv.Unavailable(t, "%s not installed", bin)
		}
	}
	// Make mangle PREROUTING exist in both families before the first snapshot: iptables-nft
	// creates a built-in chain on first use and leaves it (empty) behind, as on a node where
	// anything used mangle (kubelet's KUBE-KUBELET-CANARY); a built-in chain is not ours to remove.
	for _, bin := range []string{"iptables", "ip6tables"} {
		l.node.MustExec(t, bin, "-t", "mangle", "-A", "PREROUTING", "-j", "RETURN")
		l.node.MustExec(t, bin, "-t", "mangle", "-D", "PREROUTING", "-j", "RETURN")
	}
	before := snapshot(t, l.node)
	// What the earlier build installed.
	for _, bin := range []string{"iptables", "ip6tables"} {
		l.node.MustExec(t, bin, "-t", "mangle", "-N", LegacyChain)
		l.node.MustExec(t, bin, "-t", "mangle", "-A", LegacyChain, "-m", "conntrack", "--ctdir", "REPLY", "-j", "MARK", "--set-xmark", "0x100000/0x100000")
		l.node.MustExec(t, bin, "-t", "mangle", "-I", "PREROUTING", "1", "-j", LegacyChain)
	}
	node, _ := l.newNode(t)
	mustSync(t, node)
	during := snapshot(t, l.node)
	for _, want := range []string{"table inet " + NFTTable, "socket transparent 1", "ct mark set", "lookup 27504", "table 27504", "table bridge " + NFTTable, DefaultBridgeMAC.String()} {
		if !strings.Contains(during, want) {
			t.Errorf("after Sync, no %q in\n%s", want, during)
		}
	}
	if err := New(Config{Runner: node.cfg.Runner, Netlink: node.cfg.Netlink}).Cleanup(t.Context()); err != nil {
		t.Fatalf("Cleanup: %v", err)
	}
	if after := snapshot(t, l.node); after != before {
		t.Errorf("after Cleanup the namespace differs from before Sync:\n--- before\n%s\n--- after\n%s", before, after)
	}
	if err := node.Cleanup(t.Context()); err != nil {
		t.Errorf("second Cleanup (nothing to remove): %v", err)
	}
}

// TestSyncRepairs: whatever part someone removes, the next Sync puts back, and a Sync with
// nothing changed writes nothing.
func TestSyncRepairs(t *testing.T) {
	l := newLab(t)
	node, _ := l.newNode(t)
	mustSync(t, node)
	want := snapshot(t, l.node)
	for _, c := range []struct {
		name string
		argv [][]string
	}{
		{"nft_inet_table", [][]string{{"nft", "delete", "table", "inet", NFTTable}}},
		{"nft_mark_rule", [][]string{{"nft", "flush", "chain", "inet", NFTTable, NFTMarkChain}}},
		{"nft_mark_rule_changed", [][]string{{"nft", "flush", "chain", "inet", NFTTable, NFTMarkChain},
			{"nft", "add", "rule", "inet", NFTTable, NFTMarkChain, "meta", "mark", "set", "meta", "mark", "|", "0x00100000"}}},
		{"ip_rule_v4", [][]string{{"ip", "-4", "rule", "del", "pref", "27504"}}},
		{"ip_rule_v6", [][]string{{"ip", "-6", "rule", "del", "pref", "27504"}}},
		{"route_v4", [][]string{{"ip", "-4", "route", "flush", "table", "27504"}}},
		{"route_v6", [][]string{{"ip", "-6", "route", "flush", "table", "27504"}}},
		{"nft_bridge_table", [][]string{{"nft", "delete", "table", "bridge", NFTTable}}},
		{"nft_bridge_rule", [][]string{{"nft", "flush", "chain", "bridge", NFTTable, NFTChain}}},
		{"both_nft_tables", [][]string{{"nft", "delete", "table", "inet", NFTTable}, {"nft", "delete", "table", "bridge", NFTTable}}},
		{"fdb_entry", [][]string{{"bridge", "fdb", "del", DefaultBridgeMAC.String(), "dev", "br0", "self"}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			for _, argv := range c.argv {
				l.node.MustExec(t, argv...)
			}
			if snapshot(t, l.node) == want {
				t.Fatal("removing it changed nothing")
			}
			mustSync(t, node)
			if got := snapshot(t, l.node); got != want {
				t.Errorf("after Sync:\n%s\nwant\n%s", got, want)
			}
		})
	}
	t.Run("new_bridge_gets_the_fdb_entry", func(t *testing.T) {
		l.node.MustExec(t, "ip", "link", "add", "cni0", "type", "bridge")
		mustSync(t, node)
		if out := l.node.MustExec(t, "bridge", "fdb", "show", "br", "cni0"); !strings.Contains(out, DefaultBridgeMAC.String()) {
			t.Errorf("cni0 fdb after Sync:\n%s", out)
		}
	})
}

// BenchmarkSyncUnchanged is the per-period cost of Sync on a node where nothing changed.
func BenchmarkSyncUnchanged(b *testing.B) {
	l := newLab(b)
	node, _ := l.newNode(b)
	if _, err := node.Sync(b.Context()); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if _, err := node.Sync(b.Context()); err != nil {
			b.Fatal(err)
		}
	}
}

// countingRunner counts the writing commands a Runner runs.
type countingRunner struct {
	Runner
	writes int
}

func (c *countingRunner) NFT(ctx context.Context, stdin []byte, args ...string) ([]byte, error) {
	if stdin != nil {
		c.writes++
	}
	return c.Runner.NFT(ctx, stdin, args...)
}

// TestSyncUnchangedWritesNothing: a second Sync reads only, and how long it takes.
func TestSyncUnchangedWritesNothing(t *testing.T) {
	l := newLab(t)
	nl := &KernelNetlink{Do: l.node.Do}
	defer nl.Close()
	r := &countingRunner{Runner: &ExecRunner{iptables.ExecRunner{Prefix: l.node.CommandPrefix()}}}
	node := New(Config{Runner: r, Netlink: nl})
	mustSync(t, node)
	r.writes = 0
	const rounds = 10
	start := time.Now()
	for range rounds {
		mustSync(t, node)
	}
	t.Logf("Sync with nothing changed: %v each (%d rounds)", time.Since(start)/rounds, rounds)
	if r.writes != 0 {
		t.Errorf("%d writes in unchanged Syncs, want 0", r.writes)
	}
}
