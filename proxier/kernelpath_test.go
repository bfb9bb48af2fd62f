package proxier

// Address plan: cluster IP 10.96.0.10, endpoints 10.244.1.1-3:8080. Sockets and portals are
// fakes (sync_test.go): these tests check which path the sync puts a port on.

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

func withDataPath(v string) func(*v1.Service) {
	return func(s *v1.Service) {
		if s.Annotations == nil {
			s.Annotations = map[string]string{}
		}
		s.Annotations[AnnotationDataPath] = v
	}
}

// specOf returns the last synced spec of a port.
func (e *fakeEnv) specOf(name service.ServicePortName) (portal.Spec, bool) {
	e.portals.mu.Lock()
	defer e.portals.mu.Unlock()
	for _, s := range e.portals.specs {
		if s.Name == name {
			return s, true
		}
	}
	return portal.Spec{}, false
}

// recordEvents collects the Warning events the proxier reports.
func (e *fakeEnv) recordEvents() func() []string {
	var mu sync.Mutex
	var events []string
	e.p.deps.Event = func(n service.ServicePortName, reason, msg string) {
		mu.Lock()
		events = append(events, n.String()+" "+reason+": "+msg)
		mu.Unlock()
	}
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(events)
	}
}

func TestDataPathChoice(t *testing.T) {
	tests := []struct {
		name        string
		kernelPath  bool // the node has a kernel path (iptables mode)
		nodeDefault service.DataPath
		mutate      func(*v1.Service)
		wantKernel  bool
		wantEvent   string // substring of the Warning event, "" for none
	}{
		{name: "default_is_proxy", kernelPath: true},
		{name: "annotation_kernel", kernelPath: true, mutate: withDataPath("kernel"), wantKernel: true},
		{name: "node_default_kernel", kernelPath: true, nodeDefault: service.DataPathKernel, wantKernel: true},
		{name: "annotation_proxy_beats_node_default", kernelPath: true, nodeDefault: service.DataPathKernel, mutate: withDataPath("proxy")},
		{name: "bad_value_warns_and_takes_the_default", kernelPath: true, nodeDefault: service.DataPathKernel, mutate: withDataPath("fast"),
			wantKernel: true, wantEvent: `InvalidAnnotation: service ns/web: annotation portal-proxy.kubernetes.io/data-path="fast": want kernel or proxy`},
		{name: "bind_mode_warns_and_proxies", mutate: withDataPath("kernel"),
			wantEvent: "InvalidAnnotation: service ns/web: data path kernel: this node's portal mode has no kernel path"},
		{name: "proxy_protocol_needs_the_proxy", kernelPath: true, mutate: func(s *v1.Service) {
			withDataPath("kernel")(s)
			s.Annotations[AnnotationProxyProtocol] = "v2"
		}, wantEvent: "data path kernel cannot send a PROXY protocol header"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newFakeEnv(t, func(c *Config) { c.KernelPath, c.DefaultDataPath = tt.kernelPath, tt.nodeDefault })
			events := e.recordEvents()
			e.synced()
			e.p.OnEndpointSliceAdd(webSlice("a", 8080, "10.244.1.1", "10.244.1.2"))
			e.p.OnServiceAdd(webService(tt.mutate))
			e.sync()
			spec, ok := e.specOf(webHTTP)
			if !ok {
				t.Fatalf("no spec for %s", webHTTP)
			}
			if got := spec.Kernel != nil; got != tt.wantKernel {
				t.Errorf("on the kernel path = %v, want %v (spec %+v)", got, tt.wantKernel, spec)
			}
			if open := e.openNames(); tt.wantKernel == (len(open) > 0) {
				t.Errorf("open sockets %v with kernel path %v: a kernel port has no socket, a proxy port one", open, tt.wantKernel)
			}
			if tt.wantKernel {
				want := []netip.AddrPort{netip.MustParseAddrPort("10.244.1.1:8080"), netip.MustParseAddrPort("10.244.1.2:8080")}
				if !slices.Equal(spec.Kernel.Cluster, want) || !spec.Kernel.AnyEndpoints || spec.ProxyPort != 0 {
					t.Errorf("kernel spec %+v, want cluster endpoints %v and no proxy port", *spec.Kernel, want)
				}
				if got := e.p.DataPathOf(webHTTP); got != service.DataPathKernel {
					t.Errorf("DataPathOf = %q, want kernel", got)
				}
			}
			got := strings.Join(events(), "\n")
			if (tt.wantEvent == "") != (got == "") || !strings.Contains(got, tt.wantEvent) {
				t.Errorf("events %q, want one containing %q", got, tt.wantEvent)
			}
		})
	}
}

// TestDataPathSwitch moves a live port proxy → kernel → proxy. Going to the kernel path, the
// proxy socket stays open until a portal sync has put the kernel chains in place (so no new
// connection meets a closed port), and its close keeps established connections (tcp.Proxy.Close);
// going back, the socket is open before the sync that steers to it.
func TestDataPathSwitch(t *testing.T) {
	e := newFakeEnv(t, func(c *Config) { c.KernelPath = true })
	e.synced()
	e.p.OnEndpointSliceAdd(webSlice("a", 8080, "10.244.1.1"))
	e.p.OnServiceAdd(webService(nil))
	e.sync()
	proxySock := e.open[webHTTP]
	if proxySock == nil {
		t.Fatal("no proxy socket on the proxy path")
	}

	e.p.OnServiceUpdate(nil, webService(withDataPath("kernel")))
	e.portals.err = errors.New("restore failed")
	if err := e.p.sync(t.Context()); err == nil {
		t.Fatal("sync with failing portals: want the error")
	}
	if isClosed(proxySock) {
		t.Fatal("the proxy socket closed before the kernel chains were in place")
	}
	e.portals.err = nil
	e.sync()
	if !isClosed(proxySock) {
		t.Error("the proxy socket is still open after the sync that applied the kernel path")
	}
	if spec, _ := e.specOf(webHTTP); spec.Kernel == nil {
		t.Errorf("after the switch the spec is %+v, want the kernel path", spec)
	}

	// An endpoint change on a kernel port reaches its chains at the next sync.
	e.p.OnEndpointSliceUpdate(nil, webSlice("a", 8080, "10.244.1.1", "10.244.1.3"))
	e.sync()
	if spec, _ := e.specOf(webHTTP); spec.Kernel == nil || len(spec.Kernel.Cluster) != 2 {
		t.Errorf("after an endpoint change: %+v, want two cluster endpoints", spec.Kernel)
	}

	e.p.OnServiceUpdate(nil, webService(withDataPath("proxy")))
	e.sync()
	spec, _ := e.specOf(webHTTP)
	if spec.Kernel != nil || spec.ProxyPort == 0 || e.open[webHTTP] == nil || e.open[webHTTP] == proxySock {
		t.Errorf("back on the proxy path: spec %+v, socket %v; want a new socket and its portal", spec, e.open[webHTTP])
	}
	if got := e.p.DataPathOf(webHTTP); got != service.DataPathProxy {
		t.Errorf("DataPathOf = %q, want proxy", got)
	}

	e.p.OnServiceUpdate(nil, webService(withDataPath("kernel")))
	e.sync()
	e.p.OnServiceDelete(webService(nil))
	e.sync()
	if _, ok := e.specOf(webHTTP); ok || e.p.DataPathOf(webHTTP) != "" {
		t.Errorf("a deleted kernel port is still programmed (%q)", e.p.DataPathOf(webHTTP))
	}
}

func isClosed(s *fakeSocket) bool {
	select {
	case <-s.closed:
		return true
	default:
		return false
	}
}

// TestDataPathInTheDebugView: /debug/services says which path each port is on and shows a kernel
// port's KUBE-SEP counters.
func TestDataPathInTheDebugView(t *testing.T) {
	e := newFakeEnv(t, func(c *Config) { c.KernelPath = true })
	e.p.deps.KernelCounters = func(context.Context) ([]portal.EndpointCounter, error) {
		return []portal.EndpointCounter{{Name: webHTTP, Protocol: service.TCP, Endpoint: netip.MustParseAddrPort("10.244.1.1:8080"),
			Chain: "KUBE-SEP-X", Packets: 3, Bytes: 180}}, nil
	}
	e.synced()
	e.p.OnEndpointSliceAdd(webSlice("a", 8080, "10.244.1.1"))
	e.p.OnServiceAdd(webService(withDataPath("kernel")))
	e.p.OnServiceAdd(makeService("ns", "db", "10.96.0.11", nil, tcpPort("sql", 5432)))
	e.sync()
	got := map[string]string{}
	for _, v := range e.p.Services() {
		got[v.Name] = v.DataPath
		if v.Name == webHTTP.String() && (len(v.Kernel) != 1 || v.Kernel[0].Packets != 3 || v.Kernel[0].Chain != "KUBE-SEP-X") {
			t.Errorf("kernel counters in the view: %+v", v.Kernel)
		}
	}
	if want := map[string]string{"ns/web:http": "kernel", "ns/db:sql": "proxy"}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("data paths %v, want %v", got, want)
	}
}

// TestKernelUDPConntrack: a kernel-path UDP port that loses an endpoint has the conntrack entries
// of its destinations (its cluster, external and load-balancer IPs at its port, and its node
// port) DNATed to that endpoint cleared, as kube-proxy does (the next datagram of each is
// balanced again over the endpoints left; flows to the endpoints that stay keep theirs); one that
// goes away has every entry of its destinations cleared. Only after the sync that applied the
// change, and only its own:
// not another UDP port's, not a TCP port's that loses an endpoint, not when an endpoint is only
// added, not when nothing changed, and not when the port moves to the proxy path (its flows
// finish on their endpoint, like TCP connections). Address plan: as the file's, plus UDP
// kube-system/dns 10.96.0.53:53 (external IP 203.0.113.53, node port 30053) and kube-system/ntp
// 10.96.0.123:123, endpoints 10.244.1.1-2 on 5353 and 10.244.1.3 on 123.
func TestKernelUDPConntrack(t *testing.T) {
	e := newFakeEnv(t, func(c *Config) { c.KernelPath = true })
	e.synced()
	dns := makeService("kube-system", "dns", "10.96.0.53", func(s *v1.Service) {
		withDataPath("kernel")(s)
		s.Spec.Type = v1.ServiceTypeNodePort
		s.Spec.Ports[0].NodePort = 30053
		s.Spec.ExternalIPs = []string{"203.0.113.53"}
	}, udpPort("dns", 53))
	ntp := func(path string) *v1.Service {
		return makeService("kube-system", "ntp", "10.96.0.123", withDataPath(path), udpPort("ntp", 123))
	}
	e.p.OnServiceAdd(dns)
	e.p.OnEndpointSliceAdd(udpSlice("kube-system", "dns", "a", 5353, "10.244.1.1"))
	e.p.OnServiceAdd(ntp("kernel"))
	e.p.OnEndpointSliceAdd(udpSlice("kube-system", "ntp", "a", 123, "10.244.1.3"))
	e.p.OnServiceAdd(webService(withDataPath("kernel")))
	e.p.OnEndpointSliceAdd(webSlice("a", 8080, "10.244.1.1", "10.244.1.2"))
	e.sync()
	dnsFlows := "udp 10.96.0.53:53\nudp 203.0.113.53:53\nudp nodeport 30053"
	// to narrows each destination's line to the entries DNATed to the endpoints (the fake's dump).
	to := func(flows string, endpoints string) string {
		return strings.ReplaceAll(flows, "\n", " to ["+endpoints+"]\n") + " to [" + endpoints + "]"
	}

	var seen []string // the lines of e.conntrack.Dump() already accounted for
	cleared := func() string {
		t.Helper()
		lines := strings.Split(e.conntrack.Dump(), "\n")
		if lines[0] == "" {
			lines = nil
		}
		got := newLines(seen, lines)
		seen = lines
		return got
	}
	if got := cleared(); got != "" {
		t.Fatalf("the first sync cleared %q, want nothing", got)
	}
	steps := []struct {
		name       string
		change     func()
		failPortal bool // the portal sync fails: the change is not in force yet
		want       string
	}{
		{name: "dns_gains_an_endpoint", change: func() {
			e.p.OnEndpointSliceUpdate(nil, udpSlice("kube-system", "dns", "a", 5353, "10.244.1.1", "10.244.1.2"))
		}},
		{name: "tcp_port_loses_an_endpoint", change: func() { e.p.OnEndpointSliceUpdate(nil, webSlice("a", 8080, "10.244.1.2")) }},
		{name: "dns_loses_an_endpoint_portal_sync_fails", failPortal: true,
			change: func() { e.p.OnEndpointSliceUpdate(nil, udpSlice("kube-system", "dns", "a", 5353, "10.244.1.2")) }},
		{name: "the_sync_that_applies_it", change: func() {}, want: to(dnsFlows, "10.244.1.1:5353")},
		{name: "nothing_changed", change: func() {}},
		{name: "ntp_moves_to_the_proxy_path", change: func() { e.p.OnServiceUpdate(ntp("kernel"), ntp("proxy")) }},
		{name: "dns_endpoint_replaced", change: func() { e.p.OnEndpointSliceUpdate(nil, udpSlice("kube-system", "dns", "a", 5353, "10.244.1.4")) }, want: to(dnsFlows, "10.244.1.2:5353")},
		{name: "dns_deleted", change: func() { e.p.OnServiceDelete(dns) }, want: dnsFlows},
	}
	for _, st := range steps {
		st.change()
		if st.failPortal {
			e.portals.mu.Lock()
			e.portals.err = errors.New("restore failed")
			e.portals.mu.Unlock()
			if err := e.p.sync(t.Context()); err == nil {
				t.Fatalf("%s: sync with failing portals: want the error", st.name)
			}
			e.portals.mu.Lock()
			e.portals.err = nil
			e.portals.mu.Unlock()
		} else {
			e.sync()
		}
		if got := cleared(); got != st.want {
			t.Errorf("%s: conntrack entries cleared:\n%s\nwant:\n%s", st.name, got, st.want)
		}
	}
}

// newLines returns the lines of now that before does not account for (as multisets: the fake
// sorts its dump, so new lines land anywhere), in order, one per line.
func newLines(before, now []string) string {
	count := map[string]int{}
	for _, l := range before {
		count[l]++
	}
	var out []string
	for _, l := range now {
		if count[l] > 0 {
			count[l]--
			continue
		}
		out = append(out, l)
	}
	return strings.Join(out, "\n")
}
