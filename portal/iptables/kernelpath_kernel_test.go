package iptables

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan for the kernel-path traffic tests (all inside namespaces the test creates):
//
//	client 10.100.0.2/24 (c0) ── node 10.100.0.1/24 (n0)      node 10.244.1.1/24 (p0) ── pods (e0)
//	                                                                                      10.244.1.10-13/24
//
// The client and the pods route everything via the node, which forwards (ip_forward=1 inside its
// namespace only). Cluster IPs 10.96.0.0/16, load-balancer IP 10.96.1.20 (in the routed range),
// node port 30080 on 10.100.0.1. Each pod address runs an endpoint on :8080 that answers every
// line with "<its address> <the client address it sees>".

var podAddrs = []string{"10.244.1.10", "10.244.1.11", "10.244.1.12", "10.244.1.13"}

type pathLab struct {
	client, node, pods *netns.NS
}

// runner runs iptables in the node namespace: the system's binaries, or iptables-nft* /
// iptables-legacy* when KPP_TEST_IPTABLES_VARIANT says nft or legacy (one variant per run: the
// two must not program the same namespace).
func (l *pathLab) runner() *ExecRunner {
	return &ExecRunner{Prefix: l.node.CommandPrefix(), Do: l.node.Do, Variant: os.Getenv("KPP_TEST_IPTABLES_VARIANT")}
}

func newPathLab(t *testing.T) *pathLab {
	t.Helper()
	lab := netns.NewTestLab(t)
	l := &pathLab{client: lab.MustAdd(t, "client"), node: lab.MustAdd(t, "node"), pods: lab.MustAdd(t, "pods")}
	ctx := t.Context()
	if err := netns.Link(ctx, netns.End{NS: l.client, Dev: "c0", Addr: netip.MustParsePrefix("10.100.0.2/24")},
		netns.End{NS: l.node, Dev: "n0", Addr: netip.MustParsePrefix("10.100.0.1/24")}); err != nil {
		t.Fatal(err)
	}
	if err := netns.Link(ctx, netns.End{NS: l.pods, Dev: "e0", Addr: netip.MustParsePrefix(podAddrs[0] + "/24")},
		netns.End{NS: l.node, Dev: "p0", Addr: netip.MustParsePrefix("10.244.1.1/24")}); err != nil {
		t.Fatal(err)
	}
	for _, a := range podAddrs[1:] {
		l.pods.MustExec(t, "ip", "addr", "add", a+"/24", "dev", "e0")
	}
	def := netip.MustParsePrefix("0.0.0.0/0")
	if err := l.client.AddRoute(ctx, def, netip.MustParseAddr("10.100.0.1"), ""); err != nil {
		t.Fatal(err)
	}
	if err := l.pods.AddRoute(ctx, def, netip.MustParseAddr("10.244.1.1"), ""); err != nil {
		t.Fatal(err)
	}
	// The node's own connections to service IPs need a route before OUTPUT's DNAT sees them.
	if err := l.node.AddRoute(ctx, netip.MustParsePrefix("10.96.0.0/16"), netip.Addr{}, "n0"); err != nil {
		t.Fatal(err)
	}
	// Forwarding inside the node namespace only. Redirects off: the hairpin goes back out of the
	// interface it came in on, and redirects would use up the ICMP rate limit REJECT needs.
	l.node.MustExec(t, "sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv4.conf.all.send_redirects=0",
		"net.ipv4.conf.p0.send_redirects=0", "net.ipv4.conf.n0.send_redirects=0")
	var ln net.Listener
	if err := l.pods.Do(func() (err error) {
		ln, err = net.Listen("tcp4", "0.0.0.0:8080")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	testenv.ServeTCP(t, ln, func(c net.Conn) {
		local, remote := c.LocalAddr().(*net.TCPAddr).IP, c.RemoteAddr().(*net.TCPAddr).IP
		sc := bufio.NewScanner(c)
		for sc.Scan() {
			if _, err := fmt.Fprintf(c, "%s %s\n", local, remote); err != nil {
				return
			}
		}
	})
	return l
}

// answer is what an endpoint said: which endpoint, and which client address it saw.
type answer struct{ endpoint, client string }

// ask sends one line on c and reads the endpoint's answer.
func ask(c net.Conn) (answer, error) {
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, "?\n"); err != nil {
		return answer{}, err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return answer{}, err
	}
	ep, client, _ := strings.Cut(strings.TrimSpace(line), " ")
	return answer{ep, client}, nil
}

// dialer opens connections from a namespace: all on one thread switched into it.
func connectFrom(ns *netns.NS, local, addr string, timeout time.Duration) (net.Conn, error) {
	var c net.Conn
	err := ns.Do(func() (err error) {
		d := net.Dialer{Timeout: timeout}
		if local != "" {
			d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(local)}
		}
		c, err = d.Dial("tcp", addr)
		return err
	})
	return c, err
}

// askMany makes n connections from ns to addr, one question each, on one thread in the namespace.
func askMany(ns *netns.NS, addr string, n int) ([]answer, error) {
	out := make([]answer, 0, n)
	err := ns.Do(func() error {
		for range n {
			c, err := net.DialTimeout("tcp", addr, 5*time.Second)
			if err != nil {
				return err
			}
			a, err := ask(c)
			c.Close()
			if err != nil {
				return err
			}
			out = append(out, a)
		}
		return nil
	})
	return out, err
}

func podEndpoints(addrs ...string) []netip.AddrPort {
	var out []netip.AddrPort
	for _, a := range addrs {
		out = append(out, netip.AddrPortFrom(netip.MustParseAddr(a), 8080))
	}
	return out
}

func kernelWeb(k portal.KernelPath) portal.Spec {
	return portal.Spec{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
		ClusterIPs: addrs("10.96.0.10"), LoadBalancerIPs: addrs("10.96.1.20"), Kernel: &k}
}

// TestKernelPathTraffic sends real connections through the kernel path's chains.
func TestKernelPathTraffic(t *testing.T) {
	l := newPathLab(t)
	clk := clocktesting.NewFakePassiveClock(time.Unix(1000, 0))
	cfg := Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: netip.MustParseAddr("10.100.0.1")}, KernelPath: true,
		PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}, Clock: clk, VerifyPeriod: time.Minute}
	p := New(cfg, l.runner())
	t.Cleanup(func() { p.Cleanup(context.Background()) })
	all := podEndpoints(podAddrs...)

	t.Run("spread_over_four_endpoints_is_uniform", func(t *testing.T) {
		mustSync(t, p, []portal.Spec{kernelWeb(portal.KernelPath{Cluster: all, AnyEndpoints: true})})
		const n = 2000
		answers, err := askMany(l.client, "10.96.0.10:80", n)
		if err != nil {
			t.Fatal(err)
		}
		counts := map[string]int{}
		for _, a := range answers {
			counts[a.endpoint]++
		}
		// Chi-square against 1/4 each, 3 degrees of freedom: above 16.27 has probability 0.001
		// under a uniform spread.
		chi2, expected := 0.0, float64(n)/4
		for _, ep := range podAddrs {
			d := float64(counts[ep]) - expected
			chi2 += d * d / expected
		}
		t.Logf("%d connections: %v, chi-square %.2f", n, counts, chi2)
		if len(counts) != 4 || chi2 > 16.27 {
			t.Errorf("spread %v over %d connections: chi-square %.2f > 16.27 (p < 0.001), want uniform over 4 endpoints", counts, n, chi2)
		}
		// The DNAT rule of each KUBE-SEP chain saw each connection's first packet: its counter is
		// exactly the number of connections that endpoint answered.
		counters, err := p.KernelCounters(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]int{}
		for _, c := range counters {
			if c.Name != spn("default", "web", "http") || c.Protocol != service.TCP || c.Bytes == 0 {
				t.Errorf("counter %+v: want default/web:http TCP with bytes", c)
			}
			got[c.Endpoint.Addr().String()] = int(c.Packets)
		}
		if fmt.Sprint(got) != fmt.Sprint(counts) {
			t.Errorf("KUBE-SEP counters %v, want the connections each endpoint answered %v", got, counts)
		}
		// The client is outside the pod range: masqueraded, the endpoint sees the node.
		if answers[0].client != "10.244.1.1" {
			t.Errorf("endpoint saw client %s, want the node 10.244.1.1 (masquerade of non-pod sources)", answers[0].client)
		}
	})

	t.Run("read-back_finds_the_rules_as_generated", func(t *testing.T) {
		withAll := kernelWeb(portal.KernelPath{Cluster: all, AnyEndpoints: true, AffinitySeconds: 30})
		withAll.SourceRanges = []netip.Prefix{netip.MustParsePrefix("10.100.0.0/24")}
		mustSync(t, p, []portal.Spec{withAll})
		before := p.Stats()
		clk.SetTime(clk.Now().Add(time.Minute))
		mustSync(t, p, []portal.Spec{withAll})
		if got := p.Stats(); got.Repairs != before.Repairs || got.Restores != before.Restores {
			t.Errorf("verify sync: before %+v, after %+v; want no repair (the generated text is iptables-save's)", before, got)
		}
	})

	t.Run("affinity_sticks_then_expires", func(t *testing.T) {
		const ttl = 2
		mustSync(t, p, []portal.Spec{kernelWeb(portal.KernelPath{Cluster: all, AnyEndpoints: true, AffinitySeconds: ttl})})
		answers, err := askMany(l.client, "10.96.0.10:80", 40)
		if err != nil {
			t.Fatal(err)
		}
		first := answers[0].endpoint
		for i, a := range answers {
			if a.endpoint != first {
				t.Fatalf("connection %d reached %s, want %s like the first (ClientIP affinity)", i, a.endpoint, first)
			}
		}
		// After the timeout the next connection is spread again (and sticks anew). Each round
		// lands elsewhere with probability 3/4; eight rounds all on the same one: 1.5e-5.
		for round := range 8 {
			// xt_recent compares against the kernel's clock: the timeout has to pass in real time.
			time.Sleep(ttl*time.Second + 300*time.Millisecond)
			a, err := askMany(l.client, "10.96.0.10:80", 1)
			if err != nil {
				t.Fatal(err)
			}
			if a[0].endpoint != first {
				t.Logf("round %d: after %ds idle the client moved from %s to %s", round, ttl, first, a[0].endpoint)
				return
			}
		}
		t.Errorf("after the affinity timeout every new connection still reached %s", first)
	})

	t.Run("hairpin_pod_reaches_its_own_service", func(t *testing.T) {
		mustSync(t, p, []portal.Spec{kernelWeb(portal.KernelPath{Cluster: podEndpoints(podAddrs[0]), AnyEndpoints: true})})
		c, err := connectFrom(l.pods, podAddrs[0], "10.96.0.10:80", 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		a, err := ask(c)
		if err != nil {
			t.Fatalf("pod %s to its own service: %v", podAddrs[0], err)
		}
		if a.endpoint != podAddrs[0] || a.client != "10.244.1.1" {
			t.Errorf("hairpin answer %+v, want endpoint %s seeing the node 10.244.1.1 (masqueraded)", a, podAddrs[0])
		}
	})

	t.Run("external_local_keeps_traffic_on_the_node", func(t *testing.T) {
		mustSync(t, p, []portal.Spec{kernelWeb(portal.KernelPath{Cluster: all, Local: podEndpoints(podAddrs[0]),
			ExternalLocal: true, AnyEndpoints: true})})
		answers, err := askMany(l.client, "10.100.0.1:30080", 50)
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range answers {
			if a.endpoint != podAddrs[0] || a.client != "10.100.0.2" {
				t.Fatalf("node port under externalTrafficPolicy Local: %+v, want the local endpoint %s seeing the client 10.100.0.2", a, podAddrs[0])
			}
		}
		// No local endpoint: external traffic dropped, cluster traffic still served.
		mustSync(t, p, []portal.Spec{kernelWeb(portal.KernelPath{Cluster: all, ExternalLocal: true, AnyEndpoints: true})})
		if c, err := connectFrom(l.client, "", "10.100.0.1:30080", 700*time.Millisecond); err == nil || errors.Is(err, syscall.ECONNREFUSED) {
			if c != nil {
				c.Close()
			}
			t.Errorf("node port without a local endpoint: %v, want the SYN dropped (timeout)", err)
		}
		if _, err := askMany(l.client, "10.96.0.10:80", 5); err != nil {
			t.Errorf("cluster IP of that port: %v", err)
		}
	})

	t.Run("internal_local_without_local_endpoint_drops", func(t *testing.T) {
		mustSync(t, p, []portal.Spec{kernelWeb(portal.KernelPath{Cluster: all, InternalLocal: true, AnyEndpoints: true})})
		if c, err := connectFrom(l.client, "", "10.96.0.10:80", 700*time.Millisecond); err == nil || errors.Is(err, syscall.ECONNREFUSED) {
			if c != nil {
				c.Close()
			}
			t.Errorf("cluster IP under internalTrafficPolicy Local without a local endpoint: %v, want dropped (timeout)", err)
		}
		mustSync(t, p, []portal.Spec{kernelWeb(portal.KernelPath{Local: podEndpoints(podAddrs[1]), InternalLocal: true, AnyEndpoints: true})})
		answers, err := askMany(l.client, "10.96.0.10:80", 20)
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range answers {
			if a.endpoint != podAddrs[1] {
				t.Fatalf("cluster IP under internalTrafficPolicy Local reached %s, want the local %s", a.endpoint, podAddrs[1])
			}
		}
	})

	t.Run("source_ranges_drop_the_others", func(t *testing.T) {
		ranged := kernelWeb(portal.KernelPath{Cluster: all, AnyEndpoints: true})
		ranged.SourceRanges = []netip.Prefix{netip.MustParsePrefix("10.100.0.2/32")}
		mustSync(t, p, []portal.Spec{ranged})
		if _, err := askMany(l.client, "10.96.1.20:80", 5); err != nil {
			t.Errorf("listed client to the load-balancer IP: %v", err)
		}
		ranged.SourceRanges = []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}
		mustSync(t, p, []portal.Spec{ranged})
		if c, err := connectFrom(l.client, "", "10.96.1.20:80", 700*time.Millisecond); err == nil || errors.Is(err, syscall.ECONNREFUSED) {
			if c != nil {
				c.Close()
			}
			t.Errorf("client outside the ranges: %v, want the SYN dropped (timeout)", err)
		}
		if _, err := askMany(l.client, "10.96.0.10:80", 5); err != nil {
			t.Errorf("the same client to the cluster IP (no ranges there): %v", err)
		}
	})

	t.Run("no_endpoints_is_rejected", func(t *testing.T) {
		mustSync(t, p, []portal.Spec{kernelWeb(portal.KernelPath{})})
		for _, c := range []struct {
			from *netns.NS
			addr string
		}{{l.client, "10.96.0.10:80"}, {l.client, "10.100.0.1:30080"}, {l.client, "10.96.1.20:80"}, {l.node, "10.96.0.10:80"}} {
			start := time.Now()
			conn, err := connectFrom(c.from, "", c.addr, 5*time.Second)
			if conn != nil {
				conn.Close()
			}
			if !errors.Is(err, syscall.ECONNREFUSED) {
				t.Errorf("%s from %s: %v, want ECONNREFUSED", c.addr, c.from.Name, err)
			} else if d := time.Since(start); d > time.Second {
				t.Errorf("%s from %s: refused after %v, want at once", c.addr, c.from.Name, d)
			}
		}
	})

	t.Run("cleanup_removes_every_kernel_chain", func(t *testing.T) {
		mustSync(t, p, []portal.Spec{kernelWeb(portal.KernelPath{Cluster: all, AnyEndpoints: true, AffinitySeconds: 5})})
		if err := New(Config{}, l.runner()).Cleanup(t.Context()); err != nil {
			t.Fatal(err)
		}
		save, err := l.runner().Save(t.Context(), portal.IPv4, tableFilter)
		if err != nil {
			t.Fatal(err)
		}
		nat, err := l.runner().Save(t.Context(), portal.IPv4, tableNAT)
		if err != nil {
			t.Fatal(err)
		}
		if got := kubeLines(string(save) + string(nat)); len(got) != 2 { // "*filter", "*nat"
			t.Errorf("after Cleanup:\n%s", strings.Join(got, "\n"))
		}
	})
}

// TestKernelPathSwitchUnderLoad switches a port proxy → kernel → proxy while a client opens a
// connection every 10 ms and long connections keep talking: nothing fails, every connection
// opened after a switch's sync takes the new path, and the long ones finish on the path they
// started on. The proxy path is a forwarder in the node standing in for the proxy socket (it
// dials 10.244.1.11, so the endpoint sees the node); on the kernel path the client counts as a
// pod (PodCIDRs), so it is not masqueraded and the endpoint sees 10.100.0.2.
func TestKernelPathSwitchUnderLoad(t *testing.T) {
	l := newPathLab(t)
	proxyPort := l.forwarder(t, "10.244.1.11:8080")
	cfg := Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: netip.MustParseAddr("10.100.0.1")}, KernelPath: true,
		PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.100.0.0/24")}}
	p := New(cfg, &ExecRunner{Prefix: l.node.CommandPrefix(), Do: l.node.Do})
	t.Cleanup(func() { p.Cleanup(context.Background()) })
	proxySpec := portal.Spec{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80,
		ClusterIPs: addrs("10.96.0.10"), ProxyPort: proxyPort}
	kernelSpec := proxySpec
	kernelSpec.ProxyPort = 0
	kernelSpec.Kernel = &portal.KernelPath{Cluster: podEndpoints("10.244.1.11"), AnyEndpoints: true}
	const viaProxy, viaKernel = "10.244.1.1", "10.100.0.2" // the client address the endpoint sees

	mustSync(t, p, []portal.Spec{proxySpec})
	var (
		mu        sync.Mutex
		phase     = viaProxy // the path of the last sync that returned
		switching bool       // a sync is running: a connection may take either path
		gen       int        // counts switches
		ok, bad   atomic.Int64
		failures  []string
		// talked counts the long connections that have answered their 10 times; the run ends
		// only after every one has (under load 20 short connections can take less time).
		longs, talked atomic.Int64
	)
	// pathNow is the path a connection must take, or "" while it may take either.
	pathNow := func() (string, int) {
		mu.Lock()
		defer mu.Unlock()
		if switching {
			return "", gen
		}
		return phase, gen
	}
	// settledSince reports whether no switch started or ran since pathNow returned gen g.
	settledSince := func(g int) bool {
		want, now := pathNow()
		return want != "" && now == g
	}
	fail := func(format string, args ...any) {
		bad.Add(1)
		mu.Lock()
		failures = append(failures, fmt.Sprintf(format, args...))
		mu.Unlock()
	}
	ctx, stop := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	// Short connections, one every 10 ms.
	wg.Go(func() {
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for ctx.Err() == nil {
			want, g := pathNow()
			c, err := connectFrom(l.client, "", "10.96.0.10:80", 5*time.Second)
			if err != nil {
				fail("short connection: %v", err)
			} else {
				a, err := ask(c)
				c.Close()
				switch {
				case err != nil:
					fail("short connection: %v", err)
				case a.client != want && want != "" && settledSince(g):
					fail("short connection opened after the %s sync took the other path (endpoint saw %s)", want, a.client)
				default:
					ok.Add(1)
				}
			}
			select {
			case <-ctx.Done():
			case <-tick.C:
			}
		}
	})
	// Long connections: opened on one path, they talk every 20 ms until the end, always on it.
	long := func(want string) {
		c, err := connectFrom(l.client, "", "10.96.0.10:80", 5*time.Second)
		if err != nil {
			fail("long connection: %v", err)
			return
		}
		longs.Add(1)
		wg.Go(func() {
			defer c.Close()
			n := 0
			for ctx.Err() == nil {
				a, err := ask(c)
				if err != nil {
					fail("long connection opened on %s, after %d answers: %v", want, n, err)
					return
				}
				if a.client != want {
					fail("long connection opened on %s moved (endpoint saw %s)", want, a.client)
					return
				}
				if n++; n == 10 {
					talked.Add(1)
				}
				time.Sleep(20 * time.Millisecond) // the client's pace, not synchronisation
			}
			if n < 10 {
				fail("long connection opened on %s answered only %d times", want, n)
			}
		})
	}
	waitOK := func(more int64) {
		target := ok.Load() + more
		testenv.WaitFor(t, fmt.Sprintf("%d more good short connections", more), func() bool { return ok.Load() >= target || bad.Load() > 0 })
	}
	switchTo := func(spec portal.Spec, path string) {
		mu.Lock()
		switching = true
		mu.Unlock()
		mustSync(t, p, []portal.Spec{spec})
		mu.Lock()
		phase, switching = path, false
		gen++
		mu.Unlock()
	}

	long(viaProxy)
	long(viaProxy)
	waitOK(20)
	switchTo(kernelSpec, viaKernel)
	long(viaKernel)
	long(viaKernel)
	waitOK(20)
	switchTo(proxySpec, viaProxy)
	long(viaProxy)
	waitOK(20)
	testenv.WaitFor(t, "every long connection answered 10 times", func() bool { return talked.Load() == longs.Load() || bad.Load() > 0 })
	stop()
	wg.Wait()
	t.Logf("%d short connections answered, %d failures", ok.Load(), bad.Load())
	if bad.Load() > 0 {
		t.Errorf("%d failures:\n%s", bad.Load(), strings.Join(failures, "\n"))
	}
}

// forwarder runs, in the node namespace, a TCP forwarder standing in for a proxy socket: every
// connection is spliced to target. It returns its port.
func (l *pathLab) forwarder(t *testing.T, target string) uint16 {
	t.Helper()
	var ln net.Listener
	if err := l.node.Do(func() (err error) {
		ln, err = net.Listen("tcp4", "0.0.0.0:0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	testenv.ServeTCP(t, ln, func(c net.Conn) {
		up, err := connectFrom(l.node, "", target, 5*time.Second)
		if err != nil {
			return
		}
		defer up.Close()
		done := make(chan struct{})
		go func() { _, _ = io.Copy(up, c); up.(*net.TCPConn).CloseWrite(); close(done) }()
		_, _ = io.Copy(c, up)
		<-done
	})
	return uint16(ln.Addr().(*net.TCPAddr).Port)
}

// TestKernelPathIPv6ReadBack programs an IPv6 kernel-path port with every kind of rule (affinity,
// source ranges, node port, Local policy) into real ip6tables and checks that the read-back finds
// exactly the generated text (no repair): the IPv6 spellings (--mask ffff:..., [addr]:port,
// icmp6-port-unreachable) are ip6tables-save's. Address plan: node fd00:100::1 (no traffic).
func TestKernelPathIPv6ReadBack(t *testing.T) {
	lab := netns.NewTestLab(t)
	node := lab.MustAdd(t, "node")
	clk := clocktesting.NewFakePassiveClock(time.Unix(1000, 0))
	cfg := Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv6: labNodeV6}, KernelPath: true,
		PodCIDRs: []netip.Prefix{netip.MustParsePrefix("fd00:244::/64")}, Clock: clk, VerifyPeriod: time.Minute}
	p := New(cfg, &ExecRunner{Prefix: node.CommandPrefix(), Do: node.Do, Variant: os.Getenv("KPP_TEST_IPTABLES_VARIANT")})
	eps := []netip.AddrPort{netip.MustParseAddrPort("[fd00:244::5]:8080"), netip.MustParseAddrPort("[fd00:244::6]:8080")}
	specs := []portal.Spec{
		{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
			ClusterIPs: addrs("fd00:96::10"), ExternalIPs: addrs("2001:db8::7"), LoadBalancerIPs: addrs("2001:db8::20"),
			SourceRanges: []netip.Prefix{netip.MustParsePrefix("2001:db8:1::/48")},
			Kernel:       &portal.KernelPath{Cluster: eps, Local: eps[:1], ExternalLocal: true, AnyEndpoints: true, AffinitySeconds: 300}},
		{Name: spn("default", "dns", "dns"), Protocol: service.UDP, Port: 53, ClusterIPs: addrs("fd00:96::53"),
			Kernel: &portal.KernelPath{}},
	}
	if !HasRandomFully(t.Context(), p.runner, portal.IPv6) {
		t.Error("HasRandomFully: false on this kernel and ip6tables, want true")
	}
	mustSync(t, p, specs)
	before := p.Stats()
	clk.SetTime(clk.Now().Add(time.Minute))
	mustSync(t, p, specs)
	if got := p.Stats(); got.Repairs != 0 || got.Restores != before.Restores || got.ReadBacks <= before.ReadBacks {
		t.Errorf("verify sync: before %+v, after %+v; want a read-back that finds nothing to repair", before, got)
	}
	if err := p.Cleanup(t.Context()); err != nil {
		t.Fatal(err)
	}
}
