package proxier

import (
	"bufio"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/metrics"
)

// trafficSeries scrapes h (text, no gzip) and returns the traffic series' sample lines, sorted.
func trafficSeries(t *testing.T, h http.Handler) string {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	var out []string
	sc := bufio.NewScanner(rec.Body)
	for sc.Scan() {
		if l := sc.Text(); strings.HasPrefix(l, "kube_portal_proxy_") && strings.Contains(l, "service_port=") {
			out = append(out, l)
		}
	}
	slices.Sort(out) // ports come in map order
	return strings.Join(out, "\n")
}

// TestScrapeSeriesOfOpenPorts pins the traffic series the proxier's ports give a scrape: ns/web
// (NodePort, externalTrafficPolicy Local: a cluster and an external socket; drain-timeout and
// hold-timeout; 2 endpoints) and ns/db (ClusterIP, one endpoint), each socket with its own
// counters.
func TestScrapeSeriesOfOpenPorts(t *testing.T) {
	e := newFakeEnv(t, func(c *Config) { c.Node = NodeTopology{Name: "node-a"} })
	// What each socket counts: the web port's cluster socket (opened first) 1, its external
	// socket 4, the db port's 9, in every field.
	counts := map[string][]uint64{"ns/web:http": {1, 4}, "ns/db": {9}}
	e.wrap = func(s *fakeSocket) ProxySocket {
		name := s.port.Name.String()
		v := counts[name][0]
		counts[name] = counts[name][1:]
		st := flow.Stats{Active: int64(v), Total: 10 * v, BytesToEndpoint: 100 * v, BytesToClient: 1000 * v, NoEndpoint: v,
			SourceDenied: 2 * v, DialAttempts: 3 * v, DialFailures: 4 * v, DialRetries: 5 * v, Held: int64(v),
			TransparentDials: 6 * v, TransparentFallbacks: 7 * v}
		for i := range st.Ended {
			st.Ended[i] = 20*v + uint64(i)
		}
		for i := range st.Holds {
			st.Holds[i] = 30*v + uint64(i)
		}
		return &countingSocket{fakeSocket: s, stats: st}
	}
	e.p.OnServiceAdd(webService(func(s *v1.Service) {
		s.Spec.Type = v1.ServiceTypeNodePort
		s.Spec.Ports[0].NodePort = 30080
		s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
		s.Annotations = map[string]string{AnnotationHoldTimeout: "30s", AnnotationDrainTimeout: "1m"}
	}))
	e.p.OnEndpointSliceAdd(onNodes("10.244.2.1@node-b", "10.244.1.1@node-a"))
	e.p.OnServiceAdd(makeService("ns", "db", "10.96.0.11", nil, tcpPort("", 5432)))
	e.p.OnEndpointSliceAdd(makeSlice("ns", "db", "db-1", discovery.AddressTypeIPv4,
		[]discovery.EndpointPort{{Port: ptr(int32(5432)), Protocol: ptr(v1.ProtocolTCP), Name: ptr("")}}, sliceEP{addr: "10.244.3.1"}))
	e.synced()
	e.sync()
	got := trafficSeries(t, metrics.Handler(prometheus.NewRegistry(), e.p))
	// drain_closed_total is the sum over both sockets, 20×(1+4)+2×15, once (the external
	// socket's was counted twice before: 225).
	want := `kube_portal_proxy_drain_closed_total{protocol="tcp",service_port="ns/web:http"} 130
kube_portal_proxy_endpoints{service_port="ns/db"} 1
kube_portal_proxy_endpoints{service_port="ns/web:http"} 2
kube_portal_proxy_no_endpoint_rejects_total{protocol="tcp",service_port="ns/db"} 9
kube_portal_proxy_no_endpoint_rejects_total{protocol="tcp",service_port="ns/web:http"} 5
kube_portal_proxy_source_range_drops_total{protocol="tcp",service_port="ns/db"} 18
kube_portal_proxy_source_range_drops_total{protocol="tcp",service_port="ns/web:http"} 10
kube_portal_proxy_tcp_bytes_total{direction="to_client",service_port="ns/db"} 9000
kube_portal_proxy_tcp_bytes_total{direction="to_client",service_port="ns/web:http"} 5000
kube_portal_proxy_tcp_bytes_total{direction="to_endpoint",service_port="ns/db"} 900
kube_portal_proxy_tcp_bytes_total{direction="to_endpoint",service_port="ns/web:http"} 500
kube_portal_proxy_tcp_connections_active{service_port="ns/db"} 9
kube_portal_proxy_tcp_connections_active{service_port="ns/web:http"} 5
kube_portal_proxy_tcp_connections_total{service_port="ns/db"} 90
kube_portal_proxy_tcp_connections_total{service_port="ns/web:http"} 50
kube_portal_proxy_tcp_dial_attempts_total{service_port="ns/db"} 27
kube_portal_proxy_tcp_dial_attempts_total{service_port="ns/web:http"} 15
kube_portal_proxy_tcp_dial_failures_total{service_port="ns/db"} 36
kube_portal_proxy_tcp_dial_failures_total{service_port="ns/web:http"} 20
kube_portal_proxy_tcp_dial_retries_total{service_port="ns/db"} 45
kube_portal_proxy_tcp_dial_retries_total{service_port="ns/web:http"} 25
kube_portal_proxy_tcp_held_connections{service_port="ns/web:http"} 5
kube_portal_proxy_tcp_holds_total{outcome="aborted",service_port="ns/web:http"} 156
kube_portal_proxy_tcp_holds_total{outcome="client-gone",service_port="ns/web:http"} 158
kube_portal_proxy_tcp_holds_total{outcome="full",service_port="ns/web:http"} 154
kube_portal_proxy_tcp_holds_total{outcome="served",service_port="ns/web:http"} 150
kube_portal_proxy_tcp_holds_total{outcome="timeout",service_port="ns/web:http"} 152`
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("traffic series (-want +got):\n%s", diff)
	}
}

// TestScrapeAllocationAt10000Ports bounds what a /metrics scrape of 10,000 TCP service ports and
// 50,000 endpoints allocates, its first included (issue 39: at most 10 MB; it was 25 MB, a
// copy of every open port and every endpoint list per scrape, and a snapshot grown by append).
func TestScrapeAllocationAt10000Ports(t *testing.T) {
	e, reg := scrapeEnv(t, 10000)
	req := httptest.NewRequest(http.MethodGet, "/metrics", nil)
	req.Header.Set("Accept-Encoding", "gzip")
	w := &discardResponse{h: http.Header{}}
	h := metrics.Handler(reg, e.p)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	h.ServeHTTP(w, req)
	runtime.ReadMemStats(&after)
	first := after.TotalAlloc - before.TotalAlloc
	h.ServeHTTP(w, req)
	runtime.ReadMemStats(&before)
	t.Logf("the first scrape allocated %d bytes, the next %d", first, before.TotalAlloc-after.TotalAlloc)
	if first > 10e6 {
		t.Errorf("the first scrape of 10,000 ports allocated %d bytes, want at most 10 MB", first)
	}
	// The next is about 0.1 MB, 0.9 MB under -race (its sync.Pool drops the gzip writer at
	// random); it was 2.5 MB.
	if next := before.TotalAlloc - after.TotalAlloc; next > 2e6 {
		t.Errorf("a scrape of 10,000 ports after the first allocated %d bytes, want at most 2 MB", next)
	}
}
