package bind

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan for the bind kernel tests, all inside namespaces the tests create: the node
// namespace gets kube-portal0 with cluster IPs 10.96.0.0/16 and fd00:96::/112, external IP
// 203.0.113.7 and load-balancer IP 198.51.100.20. The traffic test uses internal/testbed: client
// 172.30.0.2 routes everything via the node at 172.30.0.1.

// nsNetlink is the real LinkManager, run inside ns; never in the root namespace. Its socket is
// closed before the namespace is deleted (cleanups run last-in first-out).
func nsNetlink(t testing.TB, ns *netns.NS) *Netlink {
	nl := &Netlink{Do: ns.Do}
	t.Cleanup(func() { nl.Close() })
	return nl
}

// guardRootARPSysctls fails the test if the root namespace's ARP sysctls changed while it ran.
func guardRootARPSysctls(t *testing.T) {
	t.Helper()
	read := func() string {
		var out []string
		for _, k := range []string{sysctlARPIgnore, sysctlARPAnnounce} {
			b, err := os.ReadFile(sysctlPath(k))
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, k+"="+strings.TrimSpace(string(b)))
		}
		return strings.Join(out, " ")
	}
	before := read()
	t.Cleanup(func() {
		if after := read(); after != before {
			t.Errorf("root namespace sysctls changed: before %s, after %s", before, after)
		}
	})
}

// ipAddrs lists the addresses `ip -o addr show dev` prints, without IPv6 link-local ones; an
// address the kernel still tests for duplicates is marked " tentative".
func ipAddrs(t *testing.T, ns *netns.NS, dev string) []string {
	t.Helper()
	var out []string
	for _, line := range strings.Split(ns.MustExec(t, "ip", "-o", "addr", "show", "dev", dev), "\n") {
		f := strings.Fields(line)
		if len(f) < 4 || strings.HasPrefix(f[3], "fe80:") {
			continue
		}
		a := f[3]
		if slices.Contains(f, "tentative") {
			a += " tentative"
		}
		out = append(out, a)
	}
	slices.Sort(out)
	return out
}

func sortedStrings(ps []netip.Prefix) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = p.String()
	}
	slices.Sort(out)
	return out
}

// addrWatch receives the namespace's address notifications. The kernel queues them while it
// handles a request, before it acks, so once a Sync returns every event it caused is waiting.
type addrWatch struct{ s *nl.NetlinkSocket }

func watchAddrs(t *testing.T, ns *netns.NS) *addrWatch {
	t.Helper()
	var s *nl.NetlinkSocket
	if err := ns.Do(func() error {
		var err error
		s, err = nl.Subscribe(unix.NETLINK_ROUTE, unix.RTNLGRP_IPV4_IFADDR, unix.RTNLGRP_IPV6_IFADDR)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return &addrWatch{s: s}
}

// drain returns the queued events in order, "add 10.96.0.10/32" or "del ...", without IPv6
// link-local addresses.
func (w *addrWatch) drain(t *testing.T) []string {
	t.Helper()
	var out []string
	buf := make([]byte, 1<<16)
	for {
		n, _, err := unix.Recvfrom(w.s.GetFd(), buf, unix.MSG_DONTWAIT)
		if errors.Is(err, unix.EAGAIN) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range msgs {
			p, ok := parseIfAddr(m.Data)
			if !ok || (p.Addr().Is6() && p.Addr().IsLinkLocalUnicast()) {
				continue
			}
			switch m.Header.Type {
			case unix.RTM_NEWADDR:
				out = append(out, "add "+p.String())
			case unix.RTM_DELADDR:
				out = append(out, "del "+p.String())
			}
		}
	}
}

// parseIfAddr reads an address notification: IFA_LOCAL when present, else IFA_ADDRESS.
func parseIfAddr(b []byte) (netip.Prefix, bool) {
	if len(b) < unix.SizeofIfAddrmsg {
		return netip.Prefix{}, false
	}
	msg := nl.DeserializeIfAddrmsg(b)
	attrs, err := nl.ParseRouteAttrAsMap(b[unix.SizeofIfAddrmsg:])
	if err != nil {
		return netip.Prefix{}, false
	}
	raw, ok := attrs[unix.IFA_LOCAL]
	if !ok {
		raw = attrs[unix.IFA_ADDRESS]
	}
	a, ok := netip.AddrFromSlice(raw.Value)
	if !ok {
		return netip.Prefix{}, false
	}
	return netip.PrefixFrom(a, int(msg.Prefixlen)), true
}

func mustBindSync(t *testing.T, b *Portals, specs []portal.Spec) {
	t.Helper()
	if err := b.Sync(t.Context(), specs); err != nil {
		t.Fatal(err)
	}
}

// TestBindKernel runs the bind portals against the real kernel in a throwaway namespace. On a
// kernel without the dummy driver (like this project's CI) the link is a bridge.
func TestBindKernel(t *testing.T) {
	guardRootARPSysctls(t)
	lab := netns.NewTestLab(t)
	node := lab.MustAdd(t, "node")
	logger, hook := quietLogger()
	b := New(Config{Logger: logger}, nsNetlink(t, node))
	web, dns := bindSpecs()[0], bindSpecs()[1]
	mustBindSync(t, b, []portal.Spec{web, dns})

	t.Run("the_link_exists_up_with_the_kind_Bind_reports", func(t *testing.T) {
		out := node.MustExec(t, "ip", "-d", "-o", "link", "show", "dev", DefaultInterface)
		if !strings.Contains(out, ",UP") {
			t.Errorf("link is not up: %s", out)
		}
		kind := b.Kind()
		if kind != LinkTypeDummy && kind != LinkTypeBridge {
			t.Fatalf("Kind() = %q, want dummy or bridge", kind)
		}
		if f := strings.Fields(out[strings.Index(out, "\\"):]); !slices.Contains(f, kind) {
			t.Errorf("ip -d link shows %q, want kind %s", out, kind)
		}
		fallbackLogged := slices.ContainsFunc(hook.AllEntries(), func(e *logrus.Entry) bool {
			return strings.Contains(e.Message, "no dummy link type")
		})
		if fallbackLogged != (kind == LinkTypeBridge) {
			t.Errorf("fallback logged = %v with kind %s", fallbackLogged, kind)
		}
	})
	t.Run("the_ARP_sysctls_are_set_in_the_namespace", func(t *testing.T) {
		got := strings.Fields(node.MustExec(t, "sysctl", "-n", "net.ipv4.conf.all.arp_ignore", "net.ipv4.conf.all.arp_announce"))
		if d := cmp.Diff([]string{"1", "2"}, got); d != "" {
			t.Errorf("arp_ignore, arp_announce (-want +got):\n%s", d)
		}
	})
	t.Run("exactly_the_service_addresses_appear_none_tentative", func(t *testing.T) {
		want := []string{"10.96.0.10/32", "10.96.0.53/32", "198.51.100.20/32", "203.0.113.7/32", "fd00:96::10/128"}
		if d := cmp.Diff(want, ipAddrs(t, node, DefaultInterface)); d != "" {
			t.Errorf("ip addr (-want +got):\n%s", d)
		}
		got, err := nsNetlink(t, node).Addrs(t.Context(), DefaultInterface)
		if err != nil {
			t.Fatal(err)
		}
		got = slices.DeleteFunc(got, func(p netip.Prefix) bool { return p.Addr().IsLinkLocalUnicast() })
		if d := cmp.Diff(want, sortedStrings(got)); d != "" {
			t.Errorf("Netlink.Addrs (-want +got):\n%s", d)
		}
	})
	t.Run("the_addresses_are_local_routes", func(t *testing.T) {
		out := node.MustExec(t, "ip", "route", "show", "table", "local", "dev", DefaultInterface)
		for _, a := range []string{"10.96.0.10", "10.96.0.53", "198.51.100.20", "203.0.113.7"} {
			if !strings.Contains(out, "local "+a+" ") {
				t.Errorf("no local route for %s:\n%s", a, out)
			}
		}
	})
	t.Run("removing_a_service_removes_exactly_its_addresses", func(t *testing.T) {
		w := watchAddrs(t, node)
		mustBindSync(t, b, []portal.Spec{dns})
		if d := cmp.Diff([]string{"10.96.0.53/32"}, ipAddrs(t, node, DefaultInterface)); d != "" {
			t.Errorf("ip addr (-want +got):\n%s", d)
		}
		want := []string{"del 10.96.0.10/32", "del 198.51.100.20/32", "del 203.0.113.7/32", "del fd00:96::10/128"}
		if d := cmp.Diff(want, w.drain(t)); d != "" {
			t.Errorf("address events (-want +got):\n%s", d)
		}
	})
	t.Run("an_unchanged_sync_changes_nothing", func(t *testing.T) {
		w := watchAddrs(t, node)
		mustBindSync(t, b, []portal.Spec{dns})
		if got := w.drain(t); len(got) != 0 {
			t.Errorf("address events = %v, want none", got)
		}
	})
	t.Run("a_restart_keeps_wanted_addresses_throughout", func(t *testing.T) {
		mustBindSync(t, b, []portal.Spec{web, dns})
		w := watchAddrs(t, node)
		restarted := New(Config{Logger: logger}, nsNetlink(t, node))
		moved := dns
		moved.ClusterIPs = addrs("10.96.0.54")
		mustBindSync(t, restarted, []portal.Spec{web, moved})
		// No event at all for the addresses that stay; the new one before the old one goes.
		want := []string{"add 10.96.0.54/32", "del 10.96.0.53/32"}
		if d := cmp.Diff(want, w.drain(t)); d != "" {
			t.Errorf("address events during the restart (-want +got):\n%s", d)
		}
		wantAddrs := []string{"10.96.0.10/32", "10.96.0.54/32", "198.51.100.20/32", "203.0.113.7/32", "fd00:96::10/128"}
		if d := cmp.Diff(wantAddrs, ipAddrs(t, node, DefaultInterface)); d != "" {
			t.Errorf("ip addr (-want +got):\n%s", d)
		}
	})
	t.Run("addresses_added_by_hand_are_removed_and_a_wrong_prefix_length_fixed", func(t *testing.T) {
		node.MustExec(t, "ip", "addr", "add", "10.96.7.7/32", "dev", DefaultInterface)
		node.MustExec(t, "ip", "addr", "del", "10.96.0.10/32", "dev", DefaultInterface)
		node.MustExec(t, "ip", "addr", "add", "10.96.0.10/24", "dev", DefaultInterface)
		mustBindSync(t, b, []portal.Spec{web})
		want := []string{"10.96.0.10/32", "198.51.100.20/32", "203.0.113.7/32", "fd00:96::10/128"}
		if d := cmp.Diff(want, ipAddrs(t, node, DefaultInterface)); d != "" {
			t.Errorf("ip addr (-want +got):\n%s", d)
		}
	})
	t.Run("a_link_set_down_by_someone_is_brought_up", func(t *testing.T) {
		node.MustExec(t, "ip", "link", "set", DefaultInterface, "down")
		mustBindSync(t, b, []portal.Spec{web})
		if out := node.MustExec(t, "ip", "-o", "link", "show", "dev", DefaultInterface); !strings.Contains(out, ",UP") {
			t.Errorf("link is not up: %s", out)
		}
	})
	t.Run("cleanup_deletes_the_link_and_a_second_cleanup_is_fine", func(t *testing.T) {
		if err := b.Cleanup(t.Context()); err != nil {
			t.Fatal(err)
		}
		if _, err := node.Exec(t.Context(), "ip", "link", "show", "dev", DefaultInterface); err == nil {
			t.Errorf("%s still exists after Cleanup", DefaultInterface)
		}
		if err := b.Cleanup(t.Context()); err != nil {
			t.Errorf("second Cleanup: %v", err)
		}
	})
	t.Run("a_foreign_link_of_that_name_is_left_alone", func(t *testing.T) {
		node.MustExec(t, "ip", "link", "add", DefaultInterface, "type", "veth", "peer", "name", "kpp-peer")
		if err := b.Sync(t.Context(), []portal.Spec{web}); err == nil || !strings.Contains(err.Error(), `kind "veth"`) {
			t.Errorf("Sync error = %v, want one about the veth", err)
		}
		if err := b.Cleanup(t.Context()); err == nil {
			t.Errorf("Cleanup deleted or accepted a veth")
		}
		node.MustExec(t, "ip", "link", "show", "dev", DefaultInterface)
		if got := ipAddrs(t, node, DefaultInterface); len(got) != 0 {
			t.Errorf("addresses on the foreign link: %v", got)
		}
	})
}

// TestNetlink checks the real LinkManager: errors for missing links and unknown kinds, idempotent
// address changes, IPv6 addresses routed locally when AddAddr returns, and sysctls.
func TestNetlink(t *testing.T) {
	lab := netns.NewTestLab(t)
	node := lab.MustAdd(t, "node")
	nl := nsNetlink(t, node)
	ctx := t.Context()
	if _, err := nl.LinkKind(ctx, "kpp-none"); !errors.Is(err, ErrLinkNotFound) {
		t.Errorf("LinkKind of a missing link = %v, want ErrLinkNotFound", err)
	}
	if err := nl.DeleteLink(ctx, "kpp-none"); !errors.Is(err, ErrLinkNotFound) {
		t.Errorf("DeleteLink of a missing link = %v, want ErrLinkNotFound", err)
	}
	if _, err := nl.Addrs(ctx, "kpp-none"); !errors.Is(err, ErrLinkNotFound) {
		t.Errorf("Addrs of a missing link = %v, want ErrLinkNotFound", err)
	}
	err := nl.EnsureLink(ctx, "kpp-x", "no-such-kind")
	if !errors.Is(err, ErrKindUnsupported) || !errors.Is(err, unix.EOPNOTSUPP) {
		t.Errorf("EnsureLink with an unknown kind = %v, want ErrKindUnsupported wrapping EOPNOTSUPP", err)
	}
	t.Logf("unknown kind: %v", err)
	if err := nl.EnsureLink(ctx, "kpp-br", LinkTypeBridge); err != nil {
		t.Fatal(err)
	}
	p := netip.MustParsePrefix("10.96.0.1/32")
	for range 2 {
		if err := nl.AddAddr(ctx, "kpp-br", p); err != nil {
			t.Errorf("AddAddr (twice is fine): %v", err)
		}
	}
	for range 2 {
		if err := nl.DelAddr(ctx, "kpp-br", p); err != nil {
			t.Errorf("DelAddr (twice is fine): %v", err)
		}
	}
	// The kernel inserts an IPv6 address's local route after it acks the add; AddAddr waits for
	// it, so the route is there the moment AddAddr returns. Each round is a fresh chance to race.
	for i := range 20 {
		v6 := netip.PrefixFrom(netip.AddrFrom16([16]byte{0: 0xfd, 2: 0x96, 15: byte(i + 1)}), 128)
		if err := nl.AddAddr(ctx, "kpp-br", v6); err != nil {
			t.Fatal(err)
		}
		var routes []netlink.Route
		if err := node.Do(func() error {
			var err error
			routes, err = netlink.RouteGet(v6.Addr().AsSlice())
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if len(routes) == 0 || routes[0].Type != unix.RTN_LOCAL {
			t.Errorf("route to %s right after AddAddr is not local: %v", v6.Addr(), routes)
		}
	}
	if err := nl.EnsureLink(ctx, "kpp-br", LinkTypeDummy); err == nil {
		t.Errorf("EnsureLink accepted a bridge as a dummy")
	}
	if err := nl.SetSysctl("net/ipv4/conf/kpp-br/arp_ignore", "2"); err != nil {
		t.Fatal(err)
	}
	if got, err := nl.Sysctl("net/ipv4/conf/kpp-br/arp_ignore"); err != nil || got != "2" {
		t.Errorf("Sysctl = %q, %v; want 2", got, err)
	}
}

// freebind lets a socket bind an address that is not (yet) local, as the proxier's sockets do in
// bind mode: they open before Sync puts the address on the link.
func freebind(_, _ string, c syscall.RawConn) error {
	var serr error
	err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_FREEBIND, 1) })
	return errors.Join(err, serr)
}

// serveBound answers on addr inside ns: TCP connections get "node\n", UDP datagrams "node <data>".
// The sockets are opened with IP_FREEBIND, before the address exists.
func serveBound(t *testing.T, ns *netns.NS, addr netip.AddrPort) {
	t.Helper()
	lc := net.ListenConfig{Control: freebind}
	var ln net.Listener
	var pc net.PacketConn
	err := ns.Do(func() error {
		var err error
		if ln, err = lc.Listen(context.Background(), "tcp", addr.String()); err != nil {
			return err
		}
		pc, err = lc.ListenPacket(context.Background(), "udp", addr.String())
		return err
	})
	if err != nil {
		if ln != nil {
			ln.Close()
		}
		t.Fatalf("listen on %s in %s: %v", addr, ns.Name, err)
	}
	testenv.ServeTCP(t, ln, func(c net.Conn) { _, _ = c.Write([]byte("node\n")) })
	var wg sync.WaitGroup
	t.Cleanup(func() { pc.Close(); wg.Wait() })
	wg.Go(func() {
		buf := make([]byte, 2048)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo(append([]byte("node "), buf[:n]...), from)
		}
	})
}

// TestBindKernelTraffic: a client namespace routed via the node reaches sockets bound on a
// cluster IP in the node namespace, TCP and UDP, with no NAT anywhere.
func TestBindKernelTraffic(t *testing.T) {
	guardRootARPSysctls(t)
	lab := netns.NewTestLab(t)
	bed, err := testbed.New(t.Context(), lab, 0)
	if err != nil {
		t.Fatal(err)
	}
	vip := netip.AddrPortFrom(netip.MustParseAddr("10.96.0.10"), 80)
	serveBound(t, bed.Node, vip)
	logger, _ := quietLogger()
	b := New(Config{Logger: logger}, nsNetlink(t, bed.Node))
	spec := portal.Spec{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80,
		ClusterIPs: []netip.Addr{vip.Addr(), netip.MustParseAddr("fd00:96::10")}, ProxyPort: 80}
	start := time.Now()
	mustBindSync(t, b, []portal.Spec{spec, {Name: spn("default", "web", "udp"), Protocol: service.UDP, Port: 80,
		ClusterIPs: spec.ClusterIPs, ProxyPort: 80}})
	t.Logf("first Sync (sysctls, link, 2 addresses): %v", time.Since(start))

	t.Run("TCP_from_the_client_namespace", func(t *testing.T) {
		got, err := testbed.Who(bed.Client, vip, 2*time.Second)
		if err != nil || got != "node" {
			t.Errorf("TCP %s from the client = %q, %v; want node", vip, got, err)
		}
	})
	t.Run("UDP_from_the_client_namespace_answered_from_the_service_IP", func(t *testing.T) {
		got, err := testbed.WhoUDP(bed.Client, vip, 2*time.Second)
		if err != nil || got != "node" {
			t.Errorf("UDP %s from the client = %q, %v; want node", vip, got, err)
		}
	})
	t.Run("IPv6_service_address_is_usable_at_once", func(t *testing.T) {
		v6 := netip.AddrPortFrom(netip.MustParseAddr("fd00:96::10"), 8080)
		var ln net.Listener
		if err := bed.Node.Do(func() error {
			var err error
			ln, err = net.Listen("tcp", v6.String()) // no IP_FREEBIND: the address must be local, not tentative
			return err
		}); err != nil {
			t.Fatalf("listen on %s without IP_FREEBIND: %v", v6, err)
		}
		defer ln.Close()
		done := make(chan error, 1)
		go func() {
			c, err := ln.Accept()
			if err == nil {
				c.Close()
			}
			done <- err
		}()
		c, err := testbed.Dial(bed.Node, v6, 2*time.Second)
		if err != nil {
			t.Fatalf("dial %s from the node: %v", v6, err)
		}
		c.Close()
		if err := <-done; err != nil {
			t.Errorf("accept: %v", err)
		}
	})
	t.Run("the_node_namespace_has_no_NAT", func(t *testing.T) {
		if _, err := os.Stat("/usr/sbin/nft"); err == nil {
			if out := bed.Node.MustExec(t, "nft", "list", "ruleset"); strings.TrimSpace(out) != "" {
				t.Errorf("nft ruleset of the node is not empty:\n%s", out)
			}
		}
		for _, bin := range []string{"iptables-save", "ip6tables-save"} {
			var got []string
			for _, l := range strings.Split(bed.Node.MustExec(t, bin, "-t", "nat"), "\n") {
				if strings.HasPrefix(l, ":") || strings.HasPrefix(l, "-") {
					name, _, _ := strings.Cut(l, " ")
					got = append(got, name)
				}
			}
			want := []string{":PREROUTING", ":INPUT", ":OUTPUT", ":POSTROUTING"}
			if len(got) != 0 && !slices.Equal(got, want) {
				t.Errorf("%s -t nat shows more than the empty built-in chains: %v", bin, got)
			}
		}
	})
	t.Run("after_removal_the_node_no_longer_owns_the_address", func(t *testing.T) {
		mustBindSync(t, b, nil)
		out := bed.Node.MustExec(t, "ip", "route", "get", vip.Addr().String())
		if strings.HasPrefix(out, "local ") {
			t.Errorf("%s is still local after its service went: %s", vip.Addr(), out)
		}
	})
}

// BenchmarkBindKernelSync measures a Sync that adds n addresses plus one that removes them again,
// and a Sync with nothing to change (sysctl reads, a link lookup and an address dump). The loop
// runs on a thread inside the namespace with a plain Netlink, as the daemon runs on a node.
func BenchmarkBindKernelSync(b *testing.B) {
	lab := netns.NewTestLab(b)
	node := lab.MustAdd(b, "node")
	logger, _ := quietLogger()
	for _, n := range []int{100, 1000, 10000} {
		specs := make([]portal.Spec, n)
		for i := range specs {
			specs[i] = portal.Spec{Name: spn("bench", fmt.Sprintf("svc%d", i), ""), Protocol: service.TCP, Port: 80,
				ClusterIPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 96, byte(i / 250), byte(i%250 + 1)})}}
		}
		nl := &Netlink{} // used only inside node.Do below
		b.Cleanup(func() { nl.Close() })
		bind := New(Config{Logger: logger}, nl)
		inNode := func(b *testing.B, fn func() error) {
			b.Helper()
			if err := node.Do(func() error {
				b.ResetTimer()
				for range b.N {
					if err := fn(); err != nil {
						return err
					}
				}
				b.StopTimer()
				return nil
			}); err != nil {
				b.Fatal(err)
			}
		}
		b.Run(fmt.Sprintf("add_and_remove_%d", n), func(b *testing.B) {
			inNode(b, func() error {
				if err := bind.Sync(context.Background(), specs); err != nil {
					return err
				}
				return bind.Sync(context.Background(), nil)
			})
		})
		b.Run(fmt.Sprintf("unchanged_%d", n), func(b *testing.B) {
			if err := node.Do(func() error { return bind.Sync(context.Background(), specs) }); err != nil {
				b.Fatal(err)
			}
			inNode(b, func() error { return bind.Sync(context.Background(), specs) })
		})
	}
}
