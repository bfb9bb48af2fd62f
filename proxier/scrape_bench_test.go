package proxier

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/metrics"
)

// countingSocket is a fake socket with counters, as a real proxy's: the scrape reads its Stats.
type countingSocket struct {
	*fakeSocket
	stats flow.Stats
}

func (s *countingSocket) Stats() flow.Stats { return s.stats }
func (s *countingSocket) Live() []flow.Info { return nil }

// discardResponse is a ResponseWriter that keeps nothing of the body.
type discardResponse struct{ h http.Header }

func (d *discardResponse) Header() http.Header         { return d.h }
func (d *discardResponse) Write(b []byte) (int, error) { return len(b), nil }
func (d *discardResponse) WriteHeader(int)             {}

// scrapeEnv is a proxier with n TCP service ports of 5 endpoints each, every socket with
// counters, and a registry of its sync series (the /metrics handler adds the traffic series).
func scrapeEnv(tb testing.TB, n int) (*fakeEnv, *prometheus.Registry) {
	e := newFakeEnv(tb, nil)
	e.wrap = func(s *fakeSocket) ProxySocket {
		return &countingSocket{fakeSocket: s, stats: flow.Stats{Total: 7, BytesToEndpoint: 1234, BytesToClient: 56789, DialAttempts: 7}}
	}
	e.synced()
	eps := make([]sliceEP, 5)
	for i := range eps {
		eps[i] = sliceEP{addr: fmt.Sprintf("10.244.0.%d", i+1)}
	}
	addServices(e, n, eps...)
	e.sync()
	reg := prometheus.NewRegistry()
	if err := e.p.deps.Metrics.Register(reg); err != nil {
		tb.Fatal(err)
	}
	return e, reg
}

// BenchmarkScrape10000Ports measures a whole /metrics scrape (text, gzip as Prometheus asks) of
// the proxier at 10,000 TCP service ports and 50,000 endpoints: the traffic source's walk of the
// ports, the balancer's state and the sockets' counters, and the writer. first is a handler's
// first scrape (what bench/scale's scrape cost sees), next one of those after it.
func BenchmarkScrape10000Ports(b *testing.B) {
	e, reg := scrapeEnv(b, 10000)
	req := httptest.NewRequest(http.MethodGet, "/metrics", nil)
	req.Header.Set("Accept-Encoding", "gzip")
	w := &discardResponse{h: http.Header{}}
	b.Run("first", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			metrics.Handler(reg, e.p).ServeHTTP(w, req)
		}
	})
	b.Run("next", func(b *testing.B) {
		h := metrics.Handler(reg, e.p)
		h.ServeHTTP(w, req)
		b.ReportAllocs()
		for b.Loop() {
			h.ServeHTTP(w, req)
		}
	})
}
