package debugview

// Address plan: the debug server is an httptest server on 127.0.0.1; the views it serves are
// fixed values (10.96.0.x service IPs, 127.0.0.1 endpoints and clients) that no socket uses.

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// fixedSource serves the same views every time and records the filters it was asked for.
type fixedSource struct {
	services []ServiceView
	conns    []ConnView

	mu    sync.Mutex
	asked [][2]string // Connections' (svc, client) arguments
}

func (s *fixedSource) Services() []ServiceView { return s.services }

func (s *fixedSource) Connections(svc, client string) []ConnView {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.asked = append(s.asked, [2]string{svc, client})
	return s.conns
}

// sampleSource is what a proxier shows with ns/echo serving one TCP connection through one
// endpoint, and ns/held holding one connection (PROXY protocol v2) for want of an endpoint.
func sampleSource() *fixedSource {
	return &fixedSource{
		services: []ServiceView{
			{
				Name: "ns/echo:tcp", Protocol: "TCP", Port: 80, ClusterIPs: []string{"10.96.0.7"}, ProxyPort: 40001,
				InternalTrafficPolicy: "Cluster", Internal: &TrafficView{Endpoints: []string{"127.0.0.1:8080"}, Reason: "policy=Cluster"},
				Listen: []string{"127.0.0.1:40001"}, Open: true, Affinity: "None", Balancing: BalancingView{Algorithm: "round-robin"},
				Endpoints: []EndpointView{{Address: "127.0.0.1:8080", Ready: true, Serving: true, InUse: true, Active: 1}},
				Active:    1, Total: 1, BytesToEndpoint: 5, BytesToClient: 5,
			},
			{
				Name: "ns/held:tcp", Protocol: "TCP", Port: 80, ClusterIPs: []string{"10.96.0.8"}, ProxyPort: 40002,
				InternalTrafficPolicy: "Cluster", Internal: &TrafficView{Endpoints: []string{}, Reason: "policy=Cluster", Held: true},
				Listen: []string{"127.0.0.1:40002"}, Open: true, Affinity: "None", Balancing: BalancingView{Algorithm: "round-robin"},
				ProxyProtocol: "v2", Hold: &HoldView{Timeout: "1m0s", Limit: 1024, Held: 1}, Active: 1, Total: 1,
			},
			{
				Name: "ns/quiet:tcp", Protocol: "TCP", Port: 80, ClusterIPs: []string{"10.96.0.9"}, DataPath: "kernel",
				InternalTrafficPolicy: "Cluster", Internal: &TrafficView{Endpoints: []string{"10.244.1.5:8080"}, Reason: "policy=Cluster"},
				Affinity: "None", Balancing: BalancingView{Algorithm: "round-robin"},
				Endpoints: []EndpointView{{Address: "10.244.1.5:8080", Ready: true, Serving: true, InUse: true}},
				Kernel:    []KernelEndpointView{{Endpoint: "10.244.1.5:8080", Chain: "KUBE-SEP-AFGSLHOD2HFNCBX4", Packets: 12, Bytes: 720}},
			},
		},
		conns: []ConnView{
			{Service: "ns/echo:tcp", Protocol: "TCP", Client: "127.0.0.1:51001", Endpoint: "127.0.0.1:8080", Age: "1s", BytesToEndpoint: 5, BytesToClient: 5},
			{Service: "ns/held:tcp", Protocol: "TCP", Client: "127.0.0.1:51002", Endpoint: "none", Age: "1s"},
		},
	}
}

// serve runs the debug endpoints of src on a loopback test server.
func serve(t *testing.T, src Source) *httptest.Server {
	t.Helper()
	mux := http.NewServeMux()
	Register(mux, src)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

// TestStatusPageInChromium loads the status page in a real headless browser and checks that the
// page's script rendered the services and connections the endpoints serve.
func TestStatusPageInChromium(t *testing.T) {
	browser := testenv.Chromium(t)
	srv := serve(t, sampleSource())
	dom := testenv.RenderedDOM(t, browser, srv.URL+"/")
	for _, want := range []string{
		"<code>ns/echo:tcp</code>",                         // the service row
		"<code>127.0.0.1:51001</code>",                     // the open connection's client
		"<code>127.0.0.1:8080</code>",                      // and its endpoint
		`<span id="conn-count">2</span>`,                   // both connections
		"cluster traffic: 127.0.0.1:8080 — policy=Cluster", // which endpoints and why
		"balancing: round-robin",                           // the balancing policy
		"127.0.0.1:8080 ready, 1 active",                   // and the endpoint's live flows
		"connections: PROXY protocol v2, held up to 1m0s while there is no endpoint (1 held, at most 1024)",
		// The kernel-path port and its KUBE-SEP counters.
		"kernel path (iptables DNAT, no proxy socket): 10.244.1.5:8080 12 connections",
		// The held connection, no endpoint yet.
		"<td><code>127.0.0.1:51002</code></td><td><code>none</code></td>",
	} {
		if !strings.Contains(dom, want) {
			t.Errorf("rendered page lacks %q; page:\n%s", want, dom)
		}
	}
	if !strings.Contains(dom, `<span id="error"></span>`) {
		t.Errorf("the page reported a refresh failure:\n%s", dom)
	}
}
