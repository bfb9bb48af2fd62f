package debugview

// Address plan: the debug server is an httptest server on 127.0.0.1; the views it serves are
// fixed values (10.96.0.x service IPs, 127.0.0.1 endpoints and clients) that no socket uses, and so
// are the flows its test /debug/flows streams.

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"reflect"
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
				SourceMode: "transparent",
				Endpoints:  []EndpointView{{Address: "127.0.0.1:8080", Ready: true, Serving: true, InUse: true, Active: 1}},
				Active:     1, Total: 1, BytesToEndpoint: 5, BytesToClient: 5,
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

// flowsEndpoint stands in for the observe hub's /debug/flows: it records each request's query and
// Accept header, answers the first with items as server-sent events and ends the stream (an open
// one would stall the browser's virtual time), and answers later ones 204, which tells an
// EventSource not to reconnect.
type flowsEndpoint struct {
	items []string // JSON items

	mu    sync.Mutex
	asked []*http.Request
}

func (f *flowsEndpoint) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	f.asked = append(f.asked, r.Clone(r.Context()))
	first := len(f.asked) == 1
	f.mu.Unlock()
	if !first {
		w.WriteHeader(http.StatusNoContent)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	for _, it := range f.items {
		fmt.Fprintf(w, "data: %s\n\n", it)
		w.(http.Flusher).Flush()
	}
}

func (f *flowsEndpoint) requests() []*http.Request {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*http.Request(nil), f.asked...)
}

// TestLiveFlowsInChromium opens the status page with a live flows filter in its address, as a
// link would, and checks that the page asked /debug/flows for exactly that filter as an event
// stream and shows the streamed flows newest first, with service, endpoint pod and verdict. Opened
// plainly, the page does not start the stream.
func TestLiveFlowsInChromium(t *testing.T) {
	browser := testenv.Chromium(t)
	flows := &flowsEndpoint{items: []string{
		`{"flow":{"time":"2026-07-01T12:00:01.234Z","id":41,"phase":"end","verdict":"forwarded","node":"node-a","namespace":"ns","service":"echo","port":"tcp","protocol":"TCP","path":"socket","client":"127.0.0.1:51001","endpoint":"127.0.0.1:8080","endpoint_pod":"ns/echo-7d9f-abcde","endpoint_node":"node-a","duration_us":12345,"bytes_to_endpoint":78,"bytes_to_client":1234,"end_reason":"client-closed"}}`,
		`{"lost":{"time":"2026-07-01T12:00:01.300Z","count":3,"reason":"slow-observer"}}`,
		`{"flow":{"time":"2026-07-01T12:00:01.400Z","id":42,"phase":"end","verdict":"refused","node":"node-a","namespace":"ns","service":"echo","port":"tcp","protocol":"TCP","path":"socket","client":"127.0.0.1:51002","end_reason":"no-endpoints"}}`,
	}}
	mux := http.NewServeMux()
	Register(mux, sampleSource())
	mux.Handle("/debug/flows", flows)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	dom := testenv.RenderedDOM(t, browser, srv.URL+"/#flows?service=ns/echo&namespace=ns&verdict=forwarded,refused")
	reqs := flows.requests()
	if len(reqs) == 0 {
		t.Fatalf("the page never asked /debug/flows; page:\n%s", dom)
	}
	want := url.Values{"follow": {"1"}, "phase": {"end"}, "service": {"ns/echo"}, "namespace": {"ns"}, "verdict": {"forwarded", "refused"}}
	if got := reqs[0].URL.Query(); !reflect.DeepEqual(got, want) {
		t.Errorf("/debug/flows query %v, want the filter's %v", got, want)
	}
	if got := reqs[0].Header.Get("Accept"); got != "text/event-stream" {
		t.Errorf("Accept %q, want text/event-stream", got)
	}
	_, live, ok := strings.Cut(dom, `<table id="flows">`)
	if !ok {
		t.Fatalf("no live flows table; page:\n%s", dom)
	}
	for _, want := range []string{
		// Newest first: the refused flow, no endpoint, then the forwarded one through its pod.
		`<td><code>ns/echo:tcp</code></td><td><code>127.0.0.1:51002</code></td><td><code>none</code></td><td>-</td><td><span class="v-refused">refused (no-endpoints)</span></td>`,
		`<td><code>ns/echo:tcp</code></td><td><code>127.0.0.1:51001</code></td><td><code>127.0.0.1:8080</code></td><td>ns/echo-7d9f-abcde</td><td><span class="v-forwarded">forwarded (client-closed)</span></td><td class="num">12.3ms</td><td class="num">78 / 1234</td>`,
	} {
		if !strings.Contains(live, want) {
			t.Errorf("live flows lack %q; table:\n%s", want, live)
		}
	}
	if i, j := strings.Index(live, "127.0.0.1:51002"), strings.Index(live, "127.0.0.1:51001"); i > j {
		t.Errorf("rows not newest first; table:\n%s", live)
	}
	for _, want := range []string{`<span id="flows-count">2</span>`, "lost 3 events (slow-observer)"} {
		if !strings.Contains(dom, want) {
			t.Errorf("page lacks %q; page:\n%s", want, dom)
		}
	}

	before := len(flows.requests())
	dom = testenv.RenderedDOM(t, browser, srv.URL+"/")
	if n := len(flows.requests()); n != before || !strings.Contains(dom, `<span id="flows-state" class="sel">stopped</span>`) {
		t.Errorf("opened plainly, the page asked /debug/flows %d times; want it stopped until asked; page:\n%s", n-before, dom)
	}
}
