package proxier

// Address plan: namespaces client (10.100.0.2/24 on c0) and node (10.100.0.1/24 on n0), linked
// by a veth pair. UDP service kube-system/dns: cluster IP 10.96.0.53:53, node port 30053. The
// client sends from the fixed source port 12345 to 10.100.0.1:30053, as the upstream conntrack
// e2e client does. The proxy socket listens in node; its sessions are opened by loop goroutines
// in the test process's namespace, so the endpoint is a UDP echo on 127.0.0.1 there (loopback
// only, nothing leaves the namespaces).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/conntrack"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
)

// upstreamWait is how long the upstream e2e spec waits for backend 1 to answer.
const upstreamWait = 60 * time.Second

// TestKernelNodePortUDPClientFromBeforeTheRules replays issue 30 (the upstream spec "Conntrack
// should be able to preserve UDP traffic when server pod cycles for a NodePort service") with
// real iptables, real conntrack and a real proxier: a client keeps sending from one source port
// to a UDP node port; the service gets its endpoint; the client must be answered well within the
// spec's 60 s.
//
//   - before_the_first_rules: the client's first datagram comes before the port's first sync
//     (the window a loaded node widens: its proxy syncs the new Service after the client pod has
//     started). The node delivers it untranslated, nothing listens on 30053, and the conntrack
//     entry without NAT pins every later datagram of the flow past the REJECT and then the
//     REDIRECT. Before the proxier cleared untranslated entries it was never answered.
//   - before_the_first_rules_port_held: the same with the daemon's portal.Held, whose socket
//     on the node port receives the pinned datagrams and never answers them.
//   - refused_first: the port's REJECT is in place before the first datagram; the REJECT drops it
//     before conntrack confirms an entry, so nothing is pinned.
func TestKernelNodePortUDPClientFromBeforeTheRules(t *testing.T) {
	for _, tc := range []struct {
		name        string
		refuseFirst bool
		holder      bool // the daemon's wiring: a PortHolder holds the node port (portal.Held)
	}{{"before_the_first_rules", false, false}, {"before_the_first_rules_port_held", false, true}, {"refused_first", true, false}} {
		t.Run(tc.name, func(t *testing.T) {
			client, node := netns.NewTestPair(t)
			echo := testenv.EchoUDP(t)
			cfg := iptables.Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: netip.MustParseAddr("10.100.0.1")}, ProtectProxyPorts: true}
			rules := iptables.New(cfg, &iptables.ExecRunner{Prefix: node.CommandPrefix(), Do: node.Do})
			var portals portal.Portals = rules
			if tc.holder {
				// The held node port is where a pinned datagram lands: queued on a socket nobody
				// reads, so the client gets neither an answer nor a refusal (the CI failure's
				// tries 5 s apart).
				held := &portal.Held{Rules: rules, Holder: portal.NewPortHolder(portal.HolderConfig{})}
				t.Cleanup(func() { _ = node.Do(func() error { return held.Cleanup(context.Background()) }) })
				portals = held
			}
			p, sync := kernelProxier(t, node, rules, portals)
			dns := makeService("kube-system", "dns", "10.96.0.53", func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeNodePort
				s.Spec.Ports[0].NodePort = 30053
			}, udpPort("dns", 53))
			p.OnServicesSynced()
			p.OnEndpointSlicesSynced()
			if tc.refuseFirst {
				p.OnServiceAdd(dns)
			}
			sync()

			c := startUDPProber(t, client, "10.100.0.2:12345", "10.100.0.1:30053")
			testenv.WaitFor(t, "the client's datagrams refused", func() bool { return c.refused.Load() >= 3 })
			entry := node.MustExec(t, "sh", "-c", "conntrack -L -p udp --dport 30053 2>/dev/null")
			t.Logf("conntrack entry of the client's flow while refused: %q", strings.TrimSpace(entry))

			if !tc.refuseFirst {
				p.OnServiceAdd(dns)
				sync()
				if !tc.holder {
					before := c.refused.Load()
					testenv.WaitFor(t, "the client refused after the REJECT is in", func() bool { return c.refused.Load() > before+2 })
				}
			}
			p.OnEndpointSliceAdd(makeSlice("kube-system", "dns", "dns-a", discovery.AddressTypeIPv4,
				[]discovery.EndpointPort{slicePortOf("dns", v1.ProtocolUDP, int32(echo.Port()))}, sliceEP{addr: "127.0.0.1"}))
			start := time.Now()
			sync()
			if !c.waitAnswered(upstreamWait / 4) {
				entry := node.MustExec(t, "sh", "-c", "conntrack -L -p udp --dport 30053 2>/dev/null")
				t.Fatalf("no answer %v after the endpoint's sync (%d datagrams refused); the flow's conntrack entry: %q",
					time.Since(start).Round(time.Millisecond), c.refused.Load(), strings.TrimSpace(entry))
			}
			t.Logf("answered %v after the endpoint's sync", time.Since(start).Round(time.Millisecond))
		})
	}
}

// kernelProxier is a proxier on real sockets, iptables (rules, behind portals) and conntrack in
// node, and its sync, run in node; its rules are removed at the end of the test.
func kernelProxier(t *testing.T, node *netns.NS, rules *iptables.Portals, portals portal.Portals) (*Proxier, func()) {
	p := New(Config{MinSyncPeriod: time.Second, SyncPeriod: time.Minute}, Deps{Balancer: loadbalancer.New(clock.RealClock{}), Portals: portals,
		Conntrack: &conntrack.Netlink{Do: node.Do}, Sockets: RealSockets(SocketConfig{})})
	ctx, cancel := context.WithCancel(t.Context())
	p.paths.runCtx = ctx
	t.Cleanup(func() { cancel(); p.shutdown(); _ = rules.Cleanup(context.Background()) })
	return p, func() {
		t.Helper()
		if err := node.Do(func() error { return p.sync(ctx) }); err != nil {
			t.Fatal(err)
		}
	}
}

// udpProber sends "hostname" from a fixed address every few milliseconds, as the e2e client's
// loop does, and counts refusals (ICMP port unreachable) and answers.
type udpProber struct {
	refused  atomic.Int64
	answered chan struct{}
}

func startUDPProber(t *testing.T, ns *netns.NS, from, to string) *udpProber {
	t.Helper()
	var conn *net.UDPConn
	if err := ns.Do(func() error {
		var err error
		conn, err = net.DialUDP("udp4", net.UDPAddrFromAddrPort(netip.MustParseAddrPort(from)), net.UDPAddrFromAddrPort(netip.MustParseAddrPort(to)))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	pr := &udpProber{answered: make(chan struct{})}
	stop, done := make(chan struct{}), make(chan struct{})
	t.Cleanup(func() { close(stop); <-done; conn.Close() })
	go func() {
		defer close(done)
		buf := make([]byte, 64)
		// Bounded: at most 2 minutes of probing, then the test has long failed.
		for end := time.Now().Add(2 * time.Minute); time.Now().Before(end); {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := conn.Write([]byte("hostname")); errors.Is(err, syscall.ECONNREFUSED) {
				pr.refused.Add(1) // the last datagram's ICMP error, reported on this call
				continue
			} else if err != nil {
				t.Errorf("probe write: %v", err)
				return
			}
			_ = conn.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
			n, err := conn.Read(buf)
			switch {
			case err == nil && string(buf[:n]) == "hostname":
				close(pr.answered)
				return
			case errors.Is(err, syscall.ECONNREFUSED):
				pr.refused.Add(1)
			case err != nil && !errors.Is(err, syscall.EAGAIN) && !isTimeout(err):
				t.Errorf("probe read: %v", err)
				return
			}
		}
	}()
	return pr
}

func (pr *udpProber) waitAnswered(d time.Duration) bool {
	select {
	case <-pr.answered:
		return true
	case <-time.After(d):
		return false
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// TestKernelClusterIPTCPClientFromBeforeTheRules: a client's SYN to a cluster IP that comes
// before the port's first rules is routed on untranslated (the node has a route for the service
// range, here on-link towards the client, whose neighbour lookup of the cluster IP fails) and its
// conntrack entry waits in SYN_SENT for 120 s. The service then gets its rules; a new connection
// from the same source port must connect, not join the old flow's untranslated entry (bench/scale
// saw "no route to host" minutes after a cold start whose probes came before the first sync).
//
// Address plan as above; the client dials cluster IP 10.96.0.80:80 from 10.100.0.2:40080; the
// endpoint is a TCP listener on 127.0.0.1 in the test process's namespace, where the proxy's
// dials run.
func TestKernelClusterIPTCPClientFromBeforeTheRules(t *testing.T) {
	client, node := netns.NewTestPair(t)
	client.MustExec(t, "ip", "route", "add", "10.96.0.0/16", "via", "10.100.0.1")
	node.MustExec(t, "ip", "route", "add", "10.96.0.0/16", "dev", "n0")
	node.MustExec(t, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	testenv.ServeTCP(t, ln, func(c net.Conn) { _, _ = c.Write([]byte("hi\n")) })
	ep := ln.Addr().(*net.TCPAddr).AddrPort()

	cfg := iptables.Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: netip.MustParseAddr("10.100.0.1")}, ProtectProxyPorts: true}
	rules := iptables.New(cfg, &iptables.ExecRunner{Prefix: node.CommandPrefix(), Do: node.Do})
	p, sync := kernelProxier(t, node, rules, rules)
	p.OnServicesSynced()
	p.OnEndpointSlicesSynced()
	sync()

	from := &net.TCPAddr{IP: net.IPv4(10, 100, 0, 2), Port: 40080}
	dial := func(timeout time.Duration) error {
		return client.Do(func() error {
			d := net.Dialer{LocalAddr: from, Timeout: timeout}
			c, err := d.Dial("tcp4", "10.96.0.80:80")
			if err != nil {
				return err
			}
			defer c.Close()
			_ = c.SetReadDeadline(time.Now().Add(timeout))
			buf := make([]byte, 3)
			if _, err := io.ReadFull(c, buf); err != nil {
				return fmt.Errorf("read greeting: %w", err)
			}
			return nil
		})
	}
	// Before the rules: the SYN is routed on, and the dial fails (its timeout, or the neighbour
	// lookup's host unreachable).
	if err := dial(500 * time.Millisecond); err == nil {
		t.Fatal("a dial to the cluster IP connected before the service had rules")
	}
	untranslated := func() string {
		out := node.MustExec(t, "sh", "-c", "conntrack -L -p tcp --sport 40080 2>/dev/null")
		if strings.Contains(out, "src=10.96.0.80 dst=10.100.0.2 sport=80 dport=40080") {
			return strings.TrimSpace(out)
		}
		return ""
	}
	testenv.WaitFor(t, "the untranslated entry of the early SYN", func() bool { return untranslated() != "" })

	web := makeService("default", "web", "10.96.0.80", nil, tcpPort("http", 80))
	p.OnServiceAdd(web)
	p.OnEndpointSliceAdd(makeSlice("default", "web", "web-a", discovery.AddressTypeIPv4,
		[]discovery.EndpointPort{slicePortOf("http", v1.ProtocolTCP, int32(ep.Port()))}, sliceEP{addr: ep.Addr().String()}))
	sync()
	if err := dial(2 * time.Second); err != nil {
		t.Fatalf("a new connection from the same source port after the service's sync: %v; its entry: %q", err, untranslated())
	}
}
