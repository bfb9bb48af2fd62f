package proxier

// Address plan: the fake-env tests use Service ns/web at 10.96.0.10:80 with endpoints
// 10.0.0.<n>:8080, nothing dialled. TestHoldAndProxyProtocolWithRealSockets listens in bind mode
// on the "cluster IP" 127.0.0.52 (a loopback address), its endpoint appears on 127.0.0.1, and the
// client dials from 127.0.0.7.

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/debugview"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/metrics"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxyprotocol"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

func TestConvertConnectionPolicyAnnotations(t *testing.T) {
	tests := []struct {
		name     string
		kv       []string
		udp      bool // the Service has a UDP port "dns" too
		wantPP   service.ProxyProtocol
		wantHold time.Duration
		wantErrs []string // substrings, one per error
	}{
		{name: "unset_is_off"},
		{name: "proxy_protocol_v1", kv: []string{AnnotationProxyProtocol, "v1"}, wantPP: service.ProxyProtocolV1},
		{name: "proxy_protocol_v2_with_spaces", kv: []string{AnnotationProxyProtocol, " v2 "}, wantPP: service.ProxyProtocolV2},
		{name: "proxy_protocol_unknown_is_off", kv: []string{AnnotationProxyProtocol, "v3"},
			wantErrs: []string{`portal-proxy.kubernetes.io/proxy-protocol="v3": want v1 or v2`}},
		{name: "proxy_protocol_true_is_off", kv: []string{AnnotationProxyProtocol, "true"}, wantErrs: []string{"no PROXY header is sent"}},
		{name: "hold_timeout", kv: []string{AnnotationHoldTimeout, "30s"}, wantHold: 30 * time.Second},
		{name: "hold_timeout_not_a_duration_refuses", kv: []string{AnnotationHoldTimeout, "30"},
			wantErrs: []string{`portal-proxy.kubernetes.io/hold-timeout="30": want a duration from 1s to 1h0m0s`}},
		{name: "hold_timeout_too_short_refuses", kv: []string{AnnotationHoldTimeout, "10ms"}, wantErrs: []string{"connections are refused"}},
		{name: "hold_timeout_too_long_refuses", kv: []string{AnnotationHoldTimeout, "2h"}, wantErrs: []string{"hold-timeout"}},
		{name: "proxy_protocol_on_a_udp_port_is_ignored_there", kv: []string{AnnotationProxyProtocol, "v2"}, udp: true,
			wantPP: service.ProxyProtocolV2, wantErrs: []string{`service port ns/web:dns: annotation portal-proxy.kubernetes.io/proxy-protocol="v2": ignored on a UDP port`}},
		{name: "hold_on_a_udp_port_is_silently_not_applied", kv: []string{AnnotationHoldTimeout, "5s"}, udp: true, wantHold: 5 * time.Second},
		{name: "both_bad_two_warnings", kv: []string{AnnotationProxyProtocol, "V1", AnnotationHoldTimeout, "forever"},
			wantErrs: []string{"proxy-protocol", "hold-timeout"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ports := []v1.ServicePort{tcpPort("http", 80)}
			if tc.udp {
				ports = append(ports, udpPort("dns", 53))
			}
			got, errs := convertService(makeService("ns", "web", "10.96.0.10", annotated(tc.kv...), ports...))
			if len(got) != len(ports) {
				t.Fatalf("ports = %v, want %d: an annotation never drops a port", got, len(ports))
			}
			if tcp := got[0]; tcp.ProxyProtocol != tc.wantPP || tcp.HoldTimeout != tc.wantHold || tcp.Holds() != (tc.wantHold > 0) {
				t.Errorf("TCP port: proxy protocol %q, hold %v, Holds %v; want %q, %v", tcp.ProxyProtocol, tcp.HoldTimeout, tcp.Holds(), tc.wantPP, tc.wantHold)
			}
			if tc.udp {
				if u := got[1]; u.ProxyProtocol != "" || u.HoldTimeout != 0 || u.Holds() {
					t.Errorf("UDP port: proxy protocol %q, hold %v; want neither", u.ProxyProtocol, u.HoldTimeout)
				}
			}
			if len(errs) != len(tc.wantErrs) {
				t.Fatalf("errors = %v, want %d", errs, len(tc.wantErrs))
			}
			for i, want := range tc.wantErrs {
				if !strings.Contains(errs[i].Error(), want) || !errors.Is(errs[i], ErrInvalidAnnotation) {
					t.Errorf("error %d = %v, want an ErrInvalidAnnotation containing %q", i, errs[i], want)
				}
			}
		})
	}
}

func TestProxyProtocolOnUDPWarnsOnTheService(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.synced()
	var events []string
	e.p.deps.Event = func(n service.ServicePortName, reason, msg string) {
		events = append(events, n.String()+" "+reason+" "+msg)
	}
	svc := makeService("ns", "dns", "10.96.0.53", annotated(AnnotationProxyProtocol, "v1"), tcpPort("tcp", 53), udpPort("udp", 53))
	e.p.OnServiceAdd(svc)
	e.p.OnServiceUpdate(nil, svc)
	if len(events) != 1 || !strings.HasPrefix(events[0], "ns/dns InvalidAnnotation ") || !strings.Contains(events[0], "ignored on a UDP port") {
		t.Errorf("events = %q, want one InvalidAnnotation event on ns/dns about its UDP port", events)
	}
}

// TestHoldingPortIsNotRefused: a port without endpoints is refused by its portals (iptables
// mode) or its closed listener (bind mode), unless it holds: then its traffic must reach the
// socket. Removing the annotation brings the refusal back.
func TestHoldingPortIsNotRefused(t *testing.T) {
	for _, bind := range []bool{false, true} {
		name := "iptables"
		if bind {
			name = "bind"
		}
		t.Run(name, func(t *testing.T) {
			e := newFakeEnv(t, func(c *Config) {
				if bind {
					c.ListenPlan = bindPlanForTest
				}
			})
			e.synced()
			refused := func() bool {
				t.Helper()
				s := e.spec(t)
				if bind && (strings.Contains(e.refusing(), "=true") != s.RejectInternal) {
					t.Fatalf("bind mode: sockets %s disagree with the spec's RejectInternal %v", e.refusing(), s.RejectInternal)
				}
				return s.RejectInternal
			}
			e.p.OnServiceAdd(webService(annotated(AnnotationHoldTimeout, "30s")))
			e.sync()
			if refused() {
				t.Errorf("holding port without endpoints refused")
			}
			if v := testutil.ToFloat64(e.p.deps.Metrics.RefusedPorts.WithLabelValues("cluster")); v != 0 {
				t.Errorf("refused cluster ports gauge = %v, want 0 for a holding port", v)
			}
			e.p.OnServiceUpdate(nil, webService(nil))
			e.sync()
			if !refused() {
				t.Errorf("port without endpoints and without hold-timeout not refused")
			}
		})
	}
}

// headerEcho serves ln: each connection must start with a PROXY header, which it sends on got,
// then it echoes.
func headerEcho(t *testing.T, ln net.Listener, got chan<- proxyprotocol.Header) {
	testenv.ServeTCP(t, ln, func(c net.Conn) {
		buf := make([]byte, 0, 512)
		for {
			var chunk [512]byte
			n, err := c.Read(chunk[:])
			buf = append(buf, chunk[:n]...)
			h, _, hn, perr := proxyprotocol.Parse(buf)
			if perr == nil {
				got <- h
				c.Write(buf[hn:])
				io.Copy(c, c)
				return
			}
			if err != nil || !errors.Is(perr, proxyprotocol.ErrIncomplete) {
				return
			}
		}
	})
}

// TestHoldAndProxyProtocolWithRealSockets runs both policies through the real proxier and TCP
// sockets: a connection to a port without endpoints is held (not refused), shown in the metrics
// and the debug view, and served as soon as an EndpointSlice brings an endpoint, without waiting
// for a sync; the endpoint reads a PROXY header naming the client and the service address first.
func TestHoldAndProxyProtocolWithRealSockets(t *testing.T) {
	epLn, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	headers := make(chan proxyprotocol.Header, 1)
	headerEcho(t, epLn, headers)
	ep := epLn.Addr().(*net.TCPAddr).AddrPort()
	// A port free on 127.0.0.52, for the service port.
	port := testenv.FreeTCPPort(t, "127.0.0.52")
	cluster := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.52"), port)

	p := New(Config{MinSyncPeriod: time.Second, SyncPeriod: time.Minute, ListenPlan: func(*service.Port) []netip.AddrPort {
		return []netip.AddrPort{cluster}
	}}, Deps{Balancer: loadbalancer.New(clock.RealClock{}), Portals: &recordingPortals{}, Sockets: RealSockets(SocketConfig{})})
	ctx, cancel := context.WithCancel(context.Background())
	p.paths.runCtx = ctx
	t.Cleanup(func() { cancel(); p.shutdown() })
	p.OnServicesSynced()
	p.OnEndpointSlicesSynced()
	p.OnServiceAdd(makeService("ns", "web", "127.0.0.52", annotated(AnnotationHoldTimeout, "1m", AnnotationProxyProtocol, "v2"),
		tcpPort("http", int32(port))))
	if err := p.sync(ctx); err != nil {
		t.Fatal(err)
	}

	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.7")}, Timeout: 5 * time.Second}
	c, err := d.Dial("tcp4", cluster.String())
	if err != nil {
		t.Fatalf("dial the holding port without endpoints: %v (want it accepted, not refused)", err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	collector := metrics.NewTrafficCollector(p)
	held := func(n int) string {
		return "# HELP kube_portal_proxy_tcp_held_connections TCP connections held now for want of an endpoint (service ports with a hold-timeout).\n" +
			"# TYPE kube_portal_proxy_tcp_held_connections gauge\n" +
			"kube_portal_proxy_tcp_held_connections{service_port=\"ns/web:http\"} " + string(rune('0'+n)) + "\n"
	}
	testenv.WaitFor(t, "the connection to be held", func() bool {
		return testutil.CollectAndCompare(collector, strings.NewReader(held(1)), "kube_portal_proxy_tcp_held_connections") == nil
	})
	v := p.Services()[0]
	if v.ProxyProtocol != "v2" || v.Hold == nil || *v.Hold != (debugview.HoldView{Timeout: "1m0s", Limit: 1024, Held: 1}) {
		t.Errorf("debug view: proxy protocol %q, hold %+v; want v2 and 1 held of at most 1024 for 1m0s", v.ProxyProtocol, v.Hold)
	}
	if v.Internal == nil || !v.Internal.Held || v.Internal.Refused {
		t.Errorf("cluster traffic view %+v, want held, not refused", v.Internal)
	}

	// The endpoint appears: the balancer gets it and the held connection is dialed, no sync.
	p.OnEndpointSliceAdd(makeSlice("ns", "web", "a", discovery.AddressTypeIPv4,
		[]discovery.EndpointPort{slicePortOf("http", v1.ProtocolTCP, int32(ep.Port()))}, sliceEP{addr: "127.0.0.1"}))
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("held connection after the endpoint appeared: %q, %v; want the echo", buf, err)
	}
	want := proxyprotocol.Header{Source: c.LocalAddr().(*net.TCPAddr).AddrPort(), Destination: cluster}
	if h := <-headers; h != want {
		t.Errorf("PROXY header %+v, want %+v", h, want)
	}
	served := held(0) + `# HELP kube_portal_proxy_tcp_holds_total TCP connections that found no endpoint on a service port with a hold-timeout, by outcome: served (an endpoint appeared), timeout (reset at the hold timeout), full (not held: the hold limit was reached; reset), aborted (the proxy socket closed first), client-gone (the client reset, or closed without sending a byte, while held).
# TYPE kube_portal_proxy_tcp_holds_total counter
kube_portal_proxy_tcp_holds_total{outcome="aborted",service_port="ns/web:http"} 0
kube_portal_proxy_tcp_holds_total{outcome="client-gone",service_port="ns/web:http"} 0
kube_portal_proxy_tcp_holds_total{outcome="full",service_port="ns/web:http"} 0
kube_portal_proxy_tcp_holds_total{outcome="served",service_port="ns/web:http"} 1
kube_portal_proxy_tcp_holds_total{outcome="timeout",service_port="ns/web:http"} 0
`
	if err := testutil.CollectAndCompare(collector, strings.NewReader(served), "kube_portal_proxy_tcp_held_connections", "kube_portal_proxy_tcp_holds_total"); err != nil {
		t.Error(err)
	}
}

// TestStatusPageShowsConnectionPolicies renders the status page in headless chromium with a
// Service that sends the PROXY protocol and holds, one connection held, and checks the line
// that shows both.
func TestStatusPageShowsConnectionPolicies(t *testing.T) {
	browser := testenv.Chromium(t)
	e := newRealEnv(t)
	e.p.OnServiceAdd(makeService("ns", "held", "10.96.0.8", annotated(AnnotationHoldTimeout, "1m", AnnotationProxyProtocol, "v2"), tcpPort("tcp", 80)))
	if err := e.p.sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	var proxyAddr string
	for _, a := range e.p.paths.activeList() {
		if a.port.Name.Name == "held" {
			proxyAddr = a.sock.Addr().String()
		}
	}
	c, err := net.Dial("tcp4", proxyAddr)
	if err != nil {
		t.Fatalf("dial the holding port: %v", err)
	}
	defer c.Close()
	testenv.WaitFor(t, "the connection to be held", func() bool {
		for _, v := range e.p.Services() {
			if v.Name == "ns/held:tcp" {
				return v.Hold != nil && v.Hold.Held == 1
			}
		}
		return false
	})
	dom := testenv.RenderedDOM(t, browser, e.srv.URL+"/")
	for _, want := range []string{
		"connections: PROXY protocol v2, held up to 1m0s while there is no endpoint (1 held, at most 1024)",
		// The held connection, no endpoint yet.
		"<td><code>" + c.LocalAddr().String() + "</code></td><td><code>none</code></td>",
		`<span id="error"></span>`,
	} {
		if !strings.Contains(dom, want) {
			t.Errorf("rendered page lacks %q; page:\n%s", want, dom)
		}
	}
}

func (s *fakeSocket) WakeHeld() {
	s.env.mu.Lock()
	s.wakes++
	s.env.mu.Unlock()
}

// TestEndpointsWakeTheHeldConnectionsOfTheirClassOfTraffic: an endpoint update wakes the socket
// of each class of traffic (cluster; a Local port's external) that has endpoints after it, not
// the others, and only on holding ports.
func TestEndpointsWakeTheHeldConnectionsOfTheirClassOfTraffic(t *testing.T) {
	local := func(s *v1.Service) {
		s.Spec.Type = v1.ServiceTypeNodePort
		s.Spec.Ports[0].NodePort = 30080
		s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
		s.Annotations = map[string]string{AnnotationHoldTimeout: "30s"}
	}
	e := newFakeEnv(t, func(c *Config) { c.Node = NodeTopology{Name: "node-a"} })
	e.p.OnServiceAdd(webService(local))
	e.synced()
	e.sync()
	wakes := func() (cluster, external int) {
		t.Helper()
		e.p.paths.mu.RLock()
		a := e.p.paths.socketOf(webHTTP)
		e.p.paths.mu.RUnlock()
		if a == nil || a.ext == nil {
			t.Fatalf("want a cluster and an external socket for %s", webHTTP)
		}
		e.mu.Lock()
		defer e.mu.Unlock()
		return a.sock.(*fakeSocket).wakes, a.ext.sock.(*fakeSocket).wakes
	}
	if s := e.spec(t); s.RejectInternal || s.RejectExternal {
		t.Fatalf("holding port without endpoints refused: %+v", s)
	}
	e.p.OnEndpointSliceAdd(onNodes("10.244.2.1@node-b")) // a remote endpoint: cluster traffic only
	if c, x := wakes(); c != 1 || x != 0 {
		t.Errorf("after a remote endpoint: wakes cluster %d external %d, want 1 0", c, x)
	}
	e.p.OnEndpointSliceUpdate(nil, onNodes("10.244.2.1@node-b", "10.244.1.1@node-a")) // a local one too
	if c, x := wakes(); c != 2 || x != 1 {
		t.Errorf("after a local endpoint: wakes cluster %d external %d, want 2 1", c, x)
	}
	e.p.OnServiceUpdate(nil, webService(func(s *v1.Service) { local(s); s.Annotations = nil }))
	e.sync() // the hold is a socket setting: new sockets
	e.p.OnEndpointSliceUpdate(nil, onNodes("10.244.1.1@node-a"))
	if c, x := wakes(); c != 0 || x != 0 {
		t.Errorf("without hold-timeout: wakes cluster %d external %d, want none", c, x)
	}
}

// TestReopenedSocketNotAdoptedForConnectionPolicies: a socket reopened at start was built without
// knowing the Service's annotations, so the first sync opens a port with a PROXY protocol or a
// hold again, on the proxy port the rules point at, as it does for the access log.
func TestReopenedSocketNotAdoptedForConnectionPolicies(t *testing.T) {
	for _, kv := range [][]string{{AnnotationProxyProtocol, "v1"}, {AnnotationHoldTimeout, "10s"}} {
		t.Run(kv[0], func(t *testing.T) {
			e := newFakeEnv(t, nil)
			e.p.Reopen([]Seed{seed("ns", "web", "http", service.TCP, 34001)})
			e.p.paths.reopen()
			reopened := e.open[webHTTP]
			e.p.OnServiceAdd(webService(annotated(kv...)))
			e.synced()
			e.sync()
			s := e.open[webHTTP]
			if s == nil || s == reopened || s.addr.Port() != 34001 {
				t.Fatalf("socket after the first sync = %v; want a new one on 34001", s)
			}
			if s.port.ProxyProtocol == "" && s.port.HoldTimeout == 0 {
				t.Errorf("new socket built for %+v, want the annotation's setting", s.port)
			}
		})
	}
}
