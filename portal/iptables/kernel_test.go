package iptables

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan for the kernel tests (all inside namespaces the test creates):
//   client 10.100.0.2/24 (veth c0)  <->  node 10.100.0.1/24 (veth n0), fd00:100::1/64 on n0
//   cluster IPs 10.96.0.0/16 and fd00:96::/112, routed from the client via the node; the node
//   routes them out of n0 so its own connections reach the OUTPUT chain.

var (
	labNodeV4 = netip.MustParseAddr("10.100.0.1")
	labNodeV6 = netip.MustParseAddr("fd00:100::1")
)

// kubeLines keeps what iptables-save shows of our chains: their declarations and every rule in or
// into them, without counters.
func kubeLines(save string) []string {
	var out []string
	for _, l := range strings.Split(save, "\n") {
		switch {
		case strings.HasPrefix(l, ":KUBE-"):
			name, _, _ := strings.Cut(l, " ")
			out = append(out, name)
		case strings.HasPrefix(l, "-A ") && strings.Contains(l, "KUBE-"), strings.HasPrefix(l, "*"):
			out = append(out, l)
		}
	}
	return out
}

func kernelSave(t *testing.T, node *netns.NS, fam portal.Family) string {
	t.Helper()
	bin := "iptables-save"
	if fam == portal.IPv6 {
		bin = "ip6tables-save"
	}
	return node.MustExec(t, bin, "-t", "filter") + node.MustExec(t, bin, "-t", "nat")
}

// TestKernelRules runs the portals against real iptables in a throwaway namespace.
func TestKernelRules(t *testing.T) {
	lab := netns.NewTestLab(t)
	node := lab.MustAdd(t, "node")
	clk := clocktesting.NewFakePassiveClock(time.Unix(1000, 0))
	cfg := Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: labNodeV4, portal.IPv6: labNodeV6}, ProtectProxyPorts: true,
		NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("10.100.0.0/24")},
		Clock:             clk, VerifyPeriod: time.Minute}
	specs := []portal.Spec{
		{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
			ClusterIPs: addrs("10.96.0.10", "fd00:96::10"), ExternalIPs: addrs("203.0.113.7", "2001:db8::7"),
			LoadBalancerIPs: addrs("198.51.100.20"), ProxyPort: 34001},
		{Name: spn("kube-system", "dns", ""), Protocol: service.UDP, Port: 53, ClusterIPs: addrs("10.96.0.53"), ProxyPort: 34002},
	}
	p := New(cfg, &ExecRunner{Prefix: node.CommandPrefix()})
	mustSync(t, p, specs)

	t.Run("iptables-save_shows_exactly_the_generated_rules", func(t *testing.T) {
		fake := NewFake()
		mustSync(t, New(cfg, fake), specs)
		for _, fam := range portal.Families {
			want := ""
			for _, table := range []string{tableFilter, tableNAT} {
				b, _ := fake.Save(t.Context(), fam, table)
				want += string(b)
			}
			got := kubeLines(kernelSave(t, node, fam))
			if d := lineDiff(strings.Join(kubeLines(want), "\n"), strings.Join(got, "\n")); d != "" {
				t.Errorf("%s rules in the kernel (-want +got):\n%s", fam, d)
			}
		}
	})

	t.Run("unchanged_sync_runs_no_restore", func(t *testing.T) {
		before := p.Stats()
		mustSync(t, p, specs)
		want := before
		want.CanaryChecks += 4 // filter and nat, both families: the canary is all a no-op sync reads
		if got := p.Stats(); got != want {
			t.Errorf("Stats() after a no-op sync = %+v, want %+v", got, want)
		}
	})

	t.Run("read-back_finds_nothing_to_repair", func(t *testing.T) {
		before := p.Stats()
		clk.SetTime(clk.Now().Add(time.Minute))
		mustSync(t, p, specs)
		got := p.Stats()
		if got.ReadBacks != before.ReadBacks+4 || got.Restores != before.Restores || got.Repairs != 0 {
			t.Errorf("verify sync: before %+v, after %+v; want 4 read-backs, no restore, no repair", before, got)
		}
	})

	t.Run("repairs_a_flushed_chain", func(t *testing.T) {
		want := kernelSave(t, node, portal.IPv4)
		node.MustExec(t, "iptables", "-t", "nat", "-F", ChainPortalsContainer)
		node.MustExec(t, "iptables", "-t", "filter", "-D", "INPUT", "1")
		clk.SetTime(clk.Now().Add(time.Minute))
		mustSync(t, p, specs)
		if d := lineDiff(strings.Join(kubeLines(want), "\n"), strings.Join(kubeLines(kernelSave(t, node, portal.IPv4)), "\n")); d != "" {
			t.Errorf("rules after repair (-want +got):\n%s", d)
		}
		if got := p.Stats().Repairs; got != 2 {
			t.Errorf("Stats().Repairs = %d, want 2 (nat and filter)", got)
		}
	})

	t.Run("small_change_is_applied", func(t *testing.T) {
		changed := slices.Clone(specs)
		changed[1].ProxyPort = 34099
		mustSync(t, p, changed)
		if got := kernelSave(t, node, portal.IPv4); !strings.Contains(got, "--dport 53 -j REDIRECT --to-ports 34099") || strings.Contains(got, "34002") {
			t.Errorf("after changing the dns proxy port to 34099 the kernel has:\n%s", got)
		}
	})

	t.Run("removal_leaves_no_trace", func(t *testing.T) {
		mustSync(t, p, nil)
		for _, fam := range portal.Families {
			for _, l := range kubeLines(kernelSave(t, node, fam)) {
				if strings.Contains(l, "--comment \"default/") || strings.Contains(l, "--comment \"kube-system/") {
					t.Errorf("%s: rule left after removing every service: %s", fam, l)
				}
			}
		}
	})

	t.Run("cleanup_removes_every_chain", func(t *testing.T) {
		mustSync(t, p, specs)
		if err := New(Config{}, &ExecRunner{Prefix: node.CommandPrefix(), Do: node.Do}).Cleanup(t.Context()); err != nil {
			t.Fatal(err)
		}
		for _, fam := range portal.Families {
			if got := kernelSave(t, node, fam); strings.Contains(got, "KUBE-PORTALS") || strings.Contains(got, "KUBE-NODEPORT") {
				t.Errorf("%s after Cleanup:\n%s", fam, got)
			}
		}
		if err := New(Config{}, &ExecRunner{Prefix: node.CommandPrefix(), Do: node.Do}).Cleanup(t.Context()); err != nil {
			t.Errorf("second Cleanup with nothing left: %v", err)
		}
	})
}

// trafficLab is a client namespace linked to a node namespace that runs a TCP listener standing in
// for a proxy socket.
type trafficLab struct {
	client, node *netns.NS
	proxyPort    uint16
}

func newTrafficLab(t *testing.T) *trafficLab {
	l := &trafficLab{}
	l.client, l.node = netns.NewTestPair(t)
	ctx := t.Context()
	clusterRange := netip.MustParsePrefix("10.96.0.0/16")
	if err := l.client.AddRoute(ctx, clusterRange, labNodeV4, ""); err != nil {
		t.Fatal(err)
	}
	if err := l.node.AddRoute(ctx, clusterRange, netip.Addr{}, "n0"); err != nil {
		t.Fatal(err)
	}
	l.proxyPort = l.listenGreeter(t)
	return l
}

// dial connects from ns and returns what the proxy socket said.
func dial(ns *netns.NS, addr string, timeout time.Duration) (string, error) {
	var got []byte
	err := ns.Do(func() error {
		c, err := net.DialTimeout("tcp", addr, timeout)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		got, err = io.ReadAll(c)
		return err
	})
	return string(got), err
}

// TestKernelTraffic sends connections through the portals: from a client namespace (PREROUTING,
// the CONTAINER chains) and from the node itself (OUTPUT, the HOST chains).
func TestKernelTraffic(t *testing.T) {
	l := newTrafficLab(t)
	spec := portal.Spec{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
		ClusterIPs: addrs("10.96.0.10"), ProxyPort: l.proxyPort}
	direct := netip.AddrPortFrom(labNodeV4, l.proxyPort).String()
	tests := []struct {
		name    string
		cfg     Config
		protect bool
	}{
		{name: "bind_any_REDIRECT_and_HOST_DNAT", cfg: Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: labNodeV4}}},
		{name: "bind_specific_DNAT", cfg: Config{BindAddress: labNodeV4}},
		{name: "guarded_proxy_port", cfg: Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: labNodeV4}, ProtectProxyPorts: true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := New(tt.cfg, &ExecRunner{Prefix: l.node.CommandPrefix()})
			mustSync(t, p, []portal.Spec{spec})
			t.Cleanup(func() { p.Cleanup(t.Context()) })
			for _, c := range []struct {
				what string
				from *netns.NS
				addr string
			}{
				{"client_to_cluster_IP", l.client, "10.96.0.10:80"},
				{"client_to_node_port", l.client, "10.100.0.1:30080"},
				{"node_to_cluster_IP", l.node, "10.96.0.10:80"},
				{"node_to_node_port", l.node, "10.100.0.1:30080"},
			} {
				got, err := dial(c.from, c.addr, 5*time.Second)
				if err != nil || !strings.HasPrefix(got, "proxy socket") {
					t.Errorf("%s %s: got %q, %v; want the proxy socket's greeting", c.what, c.addr, got, err)
				}
			}
			got, err := dial(l.client, direct, 500*time.Millisecond)
			if tt.cfg.ProtectProxyPorts && err == nil {
				t.Errorf("client straight to the proxy port %s: got %q, want the guard to drop it", direct, got)
			}
			if !tt.cfg.ProtectProxyPorts && err != nil {
				t.Errorf("client straight to the proxy port %s without the guard: %v", direct, err)
			}
		})
	}
}

// listenGreeter opens a TCP listener in the node namespace standing in for a proxy socket: it
// greets every connection with its local address and closes it. It returns the port.
func (l *trafficLab) listenGreeter(t *testing.T) uint16 {
	t.Helper()
	var ln net.Listener
	if err := l.node.Do(func() (err error) {
		ln, err = net.Listen("tcp4", "0.0.0.0:0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	testenv.ServeTCP(t, ln, func(c net.Conn) { fmt.Fprintf(c, "proxy socket, local %s", c.LocalAddr()) })
	return uint16(ln.Addr().(*net.TCPAddr).Port)
}

// udpRefused sends one datagram from ns to addr on a connected socket and reports whether the
// reply was an ICMP port unreachable (ECONNREFUSED on the next read).
func udpRefused(ns *netns.NS, addr string) (bool, error) {
	refused := false
	err := ns.Do(func() error {
		c, err := net.Dial("udp", addr)
		if err != nil {
			return err
		}
		defer c.Close()
		if _, err := c.Write([]byte("ping")); err != nil {
			return err
		}
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, err = c.Read(make([]byte, 16))
		refused = errors.Is(err, syscall.ECONNREFUSED)
		if !refused && err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			return err
		}
		return nil
	})
	return refused, err
}

// synRetransmits reads how many SYNs the TCP stack of ns has retransmitted (TcpExt
// TCPSynRetrans in the namespace's /proc/net/netstat).
func synRetransmits(t *testing.T, ns *netns.NS) int64 {
	t.Helper()
	var text []byte
	if err := ns.Do(func() error {
		var err error
		text, err = os.ReadFile("/proc/thread-self/net/netstat")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(text), "\n")
	for i := 0; i+1 < len(lines); i += 2 {
		names, values := strings.Fields(lines[i]), strings.Fields(lines[i+1])
		if len(names) == 0 || names[0] != "TcpExt:" || len(values) != len(names) {
			continue
		}
		if j := slices.Index(names, "TCPSynRetrans"); j > 0 {
			n, err := strconv.ParseInt(values[j], 10, 64)
			if err != nil {
				t.Fatalf("TCPSynRetrans in %s: %v", ns.Name, err)
			}
			return n
		}
	}
	t.Fatalf("no TcpExt TCPSynRetrans in %s's /proc/net/netstat", ns.Name)
	return 0
}

// TestKernelRefusalAndPolicies checks what the filter-table rules do to real connections: a
// service port without endpoints is refused at once (ECONNREFUSED, ICMP port unreachable for UDP)
// and steered again when it has endpoints; external traffic of an externalTrafficPolicy: Local
// port reaches its own socket while the node's own traffic stays on the cluster socket; and
// loadBalancerSourceRanges let only the listed clients reach the load-balancer IP.
// Address plan: as newTrafficLab, plus load-balancer IP 10.96.1.20 (in the routed cluster range).
func TestKernelRefusalAndPolicies(t *testing.T) {
	l := newTrafficLab(t)
	// A node forwards pod traffic; refusing a cluster IP (not a local address) happens in FORWARD.
	// The lab routes cluster IPs back out of the interface they came in on, which makes the node
	// send ICMP redirects; those use up the per-host ICMP rate limit that the port-unreachable
	// answer needs, so the lab turns them off (a real node routes them elsewhere).
	l.node.MustExec(t, "sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv4.conf.all.send_redirects=0",
		"net.ipv4.conf.n0.send_redirects=0")
	ext := l.listenGreeter(t)
	cfg := Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: labNodeV4}, ProtectProxyPorts: true}
	base := portal.Spec{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
		ClusterIPs: addrs("10.96.0.10"), LoadBalancerIPs: addrs("10.96.1.20"), ProxyPort: l.proxyPort}
	udpSpec := portal.Spec{Name: spn("default", "dns", ""), Protocol: service.UDP, Port: 53,
		ClusterIPs: addrs("10.96.0.53"), ProxyPort: 34999, RejectInternal: true, RejectExternal: true}
	p := New(cfg, &ExecRunner{Prefix: l.node.CommandPrefix(), Do: l.node.Do})
	t.Cleanup(func() { p.Cleanup(context.Background()) })

	t.Run("no_endpoints_is_refused_then_served", func(t *testing.T) {
		refused := base
		refused.RejectInternal, refused.RejectExternal = true, true
		mustSync(t, p, []portal.Spec{refused, udpSpec})
		for _, c := range []struct {
			from *netns.NS
			addr string
		}{{l.client, "10.96.0.10:80"}, {l.client, "10.100.0.1:30080"}, {l.client, "10.96.1.20:80"},
			{l.node, "10.96.0.10:80"}, {l.node, "10.100.0.1:30080"}} {
			// "At once" is the kernel's view: the REJECT answered the first SYN, none was
			// retransmitted. The wall time is only logged: a 1 s bound on it failed 2 of 20 runs
			// at load up to 50 and did not fail in 80 runs here at load 5-12 (30 of them timed: every refusal
			// within 8 ms), so a lost SYN and a starved test could not be told apart; the counter
			// tells them apart.
			retrans := synRetransmits(t, c.from)
			start := time.Now()
			_, err := dial(c.from, c.addr, 5*time.Second)
			d := time.Since(start)
			if !errors.Is(err, syscall.ECONNREFUSED) {
				t.Errorf("%s from %s: %v, want ECONNREFUSED", c.addr, c.from.Name, err)
			} else if n := synRetransmits(t, c.from) - retrans; n != 0 {
				t.Errorf("%s from %s: refused after %v and %d SYN retransmission(s), want the first SYN refused", c.addr, c.from.Name, d, n)
			} else if d > time.Second {
				t.Logf("%s from %s: refused at the first SYN, %v after the dial began (a busy machine)", c.addr, c.from.Name, d)
			}
		}
		if ok, err := udpRefused(l.client, "10.96.0.53:53"); err != nil || !ok {
			t.Errorf("UDP to 10.96.0.53:53 without endpoints: refused=%v err=%v, want ICMP port unreachable", ok, err)
		}
		mustSync(t, p, []portal.Spec{base})
		if got, err := dial(l.client, "10.96.0.10:80", 5*time.Second); err != nil || !strings.HasPrefix(got, "proxy socket") {
			t.Errorf("cluster IP once endpoints exist: %q, %v", got, err)
		}
	})

	t.Run("external_local_has_its_own_socket", func(t *testing.T) {
		local := base
		local.ExternalProxyPort = ext
		mustSync(t, p, []portal.Spec{local})
		wantPort := func(from *netns.NS, addr string, port uint16) {
			t.Helper()
			got, err := dial(from, addr, 5*time.Second)
			if err != nil || !strings.HasSuffix(got, fmt.Sprintf(":%d", port)) {
				t.Errorf("%s from %s: %q, %v; want the socket on port %d", addr, from.Name, got, err, port)
			}
		}
		wantPort(l.client, "10.100.0.1:30080", ext)
		wantPort(l.client, "10.96.1.20:80", ext)
		wantPort(l.client, "10.96.0.10:80", l.proxyPort)
		wantPort(l.node, "10.100.0.1:30080", l.proxyPort)

		local.RejectExternal = true // no local endpoint: outside traffic refused, cluster traffic served
		mustSync(t, p, []portal.Spec{local})
		if _, err := dial(l.client, "10.100.0.1:30080", 5*time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("node port of an ETP=Local port without local endpoints: %v, want ECONNREFUSED", err)
		}
		wantPort(l.client, "10.96.0.10:80", l.proxyPort)
		wantPort(l.node, "10.100.0.1:30080", l.proxyPort)
	})

	t.Run("source_ranges_admit_only_listed_clients", func(t *testing.T) {
		ranged := base
		ranged.SourceRanges = []netip.Prefix{netip.MustParsePrefix("10.100.0.2/32")}
		mustSync(t, p, []portal.Spec{ranged})
		if got, err := dial(l.client, "10.96.1.20:80", 5*time.Second); err != nil || !strings.HasPrefix(got, "proxy socket") {
			t.Errorf("allowed client to the LB IP: %q, %v", got, err)
		}
		ranged.SourceRanges = []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}
		mustSync(t, p, []portal.Spec{ranged})
		got, err := dial(l.client, "10.96.1.20:80", 700*time.Millisecond)
		if err == nil || errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("client outside the ranges to the LB IP: %q, %v; want the SYN dropped (timeout)", got, err)
		}
		if got, err := dial(l.client, "10.96.0.10:80", 5*time.Second); err != nil || !strings.HasPrefix(got, "proxy socket") {
			t.Errorf("the same client to the cluster IP (no ranges there): %q, %v", got, err)
		}
	})

	t.Run("pods_reach_external_portals_as_cluster_traffic", func(t *testing.T) {
		if err := p.Cleanup(t.Context()); err != nil {
			t.Fatal(err)
		}
		// The client's range given as the pods' range (--cluster-cidr).
		pods := New(Config{HostIPs: cfg.HostIPs, ProtectProxyPorts: true,
			PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.100.0.0/24")}}, &ExecRunner{Prefix: l.node.CommandPrefix(), Do: l.node.Do})
		t.Cleanup(func() { pods.Cleanup(context.Background()) })
		local := base
		local.ExternalProxyPort = ext
		mustSync(t, pods, []portal.Spec{local})
		for _, addr := range []string{"10.100.0.1:30080", "10.96.1.20:80"} {
			got, err := dial(l.client, addr, 5*time.Second)
			if err != nil || !strings.HasSuffix(got, fmt.Sprintf(":%d", l.proxyPort)) {
				t.Errorf("pod to %s: %q, %v; want the cluster socket on port %d", addr, got, err, l.proxyPort)
			}
		}
	})
}
