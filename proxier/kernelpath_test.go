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
	discovery "k8s.io/api/discovery/v1"

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

// TestKernelUDPConntrack: a kernel-path UDP port that loses an endpoint, or goes away, has its
// conntrack entries cleared after the sync that applied it (a chatty client would otherwise stay
// DNATed to the old endpoint); one that only gains an endpoint keeps them.
func TestKernelUDPConntrack(t *testing.T) {
	e := newFakeEnv(t, func(c *Config) { c.KernelPath = true })
	e.synced()
	dns := makeService("kube-system", "dns", "10.96.0.53", withDataPath("kernel"), udpPort("dns", 53))
	slice := func(addrs ...string) *discovery.EndpointSlice {
		var eps []sliceEP
		for _, a := range addrs {
			eps = append(eps, sliceEP{addr: a})
		}
		return makeSlice("kube-system", "dns", "a", discovery.AddressTypeIPv4, []discovery.EndpointPort{slicePortOf("dns", v1.ProtocolUDP, 5353)}, eps...)
	}
	e.p.OnServiceAdd(dns)
	e.p.OnEndpointSliceAdd(slice("10.244.1.1"))
	e.sync()
	e.p.OnEndpointSliceUpdate(nil, slice("10.244.1.1", "10.244.1.2"))
	e.sync()
	if got := e.conntrack.Dump(); got != "" {
		t.Errorf("an endpoint added: conntrack cleared %q, want nothing", got)
	}
	e.p.OnEndpointSliceUpdate(nil, slice("10.244.1.2"))
	e.sync()
	if got := e.conntrack.Dump(); !strings.Contains(got, "10.96.0.53") {
		t.Errorf("an endpoint removed: conntrack cleared %q, want the flows of 10.96.0.53:53", got)
	}
}
