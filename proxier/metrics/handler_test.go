package metrics

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// mixedPorts has a port of every kind of series: TCP with and without holds, UDP, outlier
// detection, drain, transparent, unobserved, and a name to escape.
func mixedPorts() ports {
	var ended [flow.NumEndReasons]uint64
	ended[flow.IdleTimeout], ended[flow.EndpointRemoved] = 2, 1
	return ports{
		{Name: webPort("http"), Protocol: service.TCP, Balanced: true, Endpoints: 3, Observed: true,
			Stats: flow.Stats{Active: 1, Total: 1_000_000, BytesToEndpoint: 1 << 40, BytesToClient: 20, NoEndpoint: 4, DialAttempts: 5,
				DialFailures: 1, DialRetries: 1, SourceDenied: 2, Held: 1, Holds: [flow.NumHoldOutcomes]uint64{1, 2, 3, 4, 5}}, Holds: true},
		{Name: webPort("dns"), Protocol: service.UDP, Balanced: true, Observed: true, Outlier: true, Ejections: 2, Ejected: 1,
			Drain: true, Drained: 3, Transparent: true, TransparentDials: 4, TransparentFallbacks: 1,
			Stats: flow.Stats{Total: 5, Ended: ended, PacketsToEndpoint: 7, PacketsToClient: 8, BytesToEndpoint: 9, DropsTruncated: 1}},
		{Name: service.ServicePortName{Namespace: "ns", Name: "odd"}, Protocol: service.TCP, Observed: true, Drain: true, Transparent: true},
		{Name: service.ServicePortName{Namespace: "ns", Name: "quote", Port: `a"b\c`}, Protocol: service.TCP, Balanced: true},
		{Name: webPort("closed"), Protocol: service.TCP},
	}
}

// families parses a text exposition and prints it canonically (families and series sorted), so
// two expositions of the same series compare equal whatever their order.
func canonical(t *testing.T, r io.Reader) string {
	t.Helper()
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(r)
	if err != nil {
		t.Fatalf("parse exposition: %v", err)
	}
	var b bytes.Buffer
	for _, name := range slices.Sorted(func(yield func(string) bool) {
		for n := range mfs {
			if !yield(n) {
				return
			}
		}
	}) {
		mf := mfs[name]
		slices.SortFunc(mf.Metric, func(a, b *dto.Metric) int { return strings.Compare(a.String(), b.String()) })
		if _, err := expfmt.MetricFamilyToText(&b, mf); err != nil {
			t.Fatal(err)
		}
	}
	return b.String()
}

// registryText is what a registry with the traffic collector (and reg's series) exposes.
func registryText(t *testing.T, src TrafficSource, extra ...prometheus.Collector) string {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(append(extra, NewTrafficCollector(src))...)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	for _, mf := range mfs {
		if _, err := expfmt.MetricFamilyToText(&b, mf); err != nil {
			t.Fatal(err)
		}
	}
	return canonical(t, &b)
}

func TestHandlerWritesWhatTheRegistryWould(t *testing.T) {
	sync := prometheus.NewCounter(prometheus.CounterOpts{Name: "kubeproxy_sync_proxy_rules_endpoint_changes_total", Help: "x"})
	sync.Add(3)
	for _, tc := range []struct {
		name  string
		ports ports
	}{
		{"every_kind_of_port", mixedPorts()},
		{"no_ports", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg := prometheus.NewRegistry()
			reg.MustRegister(sync)
			rec := httptest.NewRecorder()
			Handler(reg, tc.ports).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
			if ct := rec.Header().Get("Content-Type"); !strings.HasPrefix(ct, "text/plain; version=0.0.4") {
				t.Errorf("Content-Type %q, want the text format", ct)
			}
			want := registryText(t, tc.ports, sync)
			if diff := cmp.Diff(want, canonical(t, rec.Body)); diff != "" {
				t.Errorf("exposition (-registry +handler):\n%s", diff)
			}
		})
	}
}

func TestHandlerGzipAndProtobuf(t *testing.T) {
	want := registryText(t, mixedPorts())
	t.Run("gzip", func(t *testing.T) {
		req := httptest.NewRequest(http.MethodGet, "/metrics", nil)
		req.Header.Set("Accept-Encoding", "gzip")
		rec := httptest.NewRecorder()
		Handler(prometheus.NewRegistry(), mixedPorts()).ServeHTTP(rec, req)
		if got := rec.Header().Get("Content-Encoding"); got != "gzip" {
			t.Fatalf("Content-Encoding %q, want gzip", got)
		}
		zr, err := gzip.NewReader(rec.Body)
		if err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(want, canonical(t, zr)); diff != "" {
			t.Errorf("exposition (-registry +handler):\n%s", diff)
		}
	})
	t.Run("protobuf_through_the_collector", func(t *testing.T) {
		req := httptest.NewRequest(http.MethodGet, "/metrics", nil)
		req.Header.Set("Accept", string(expfmt.NewFormat(expfmt.TypeProtoDelim)))
		rec := httptest.NewRecorder()
		Handler(prometheus.NewRegistry(), mixedPorts()).ServeHTTP(rec, req)
		dec := expfmt.NewDecoder(rec.Body, expfmt.ResponseFormat(rec.Result().Header))
		var text bytes.Buffer
		for {
			var mf dto.MetricFamily
			if err := dec.Decode(&mf); err == io.EOF {
				break
			} else if err != nil {
				t.Fatal(err)
			}
			if _, err := expfmt.MetricFamilyToText(&text, &mf); err != nil {
				t.Fatal(err)
			}
		}
		if diff := cmp.Diff(want, canonical(t, &text)); diff != "" {
			t.Errorf("exposition (-registry +protobuf):\n%s", diff)
		}
	})
}

// manyPorts is n idle TCP service ports with a balancer entry each, as at a file-mode cold start.
func manyPorts(n int) ports {
	p := make(ports, n)
	for i := range p {
		p[i] = PortTraffic{Name: service.ServicePortName{Namespace: "bulk", Name: fmt.Sprintf("s%d", i), Port: "http"},
			Protocol: service.TCP, Balanced: true, Endpoints: 5, Observed: true}
	}
	return p
}

// discard is a ResponseWriter that keeps nothing, so a scrape's figure is the handler's own.
type discard struct{ h http.Header }

func (d *discard) Header() http.Header         { return d.h }
func (d *discard) Write(b []byte) (int, error) { return len(b), nil }
func (d *discard) WriteHeader(int)             {}

// oldHandler is /metrics before Handler: promhttp over a registry holding the traffic collector.
func oldHandler(src TrafficSource) http.Handler {
	reg := prometheus.NewRegistry()
	reg.MustRegister(NewTrafficCollector(src))
	return promhttpHandler(reg)
}

// scrapeBytes is the heap a scrape of h allocates (the mean over runs, after a first one).
func scrapeBytes(h http.Handler, runs int) uint64 {
	req := httptest.NewRequest(http.MethodGet, "/metrics", nil)
	w := &discard{h: http.Header{}}
	h.ServeHTTP(w, req)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range runs {
		h.ServeHTTP(w, req)
	}
	runtime.ReadMemStats(&after)
	return (after.TotalAlloc - before.TotalAlloc) / uint64(runs)
}

// TestScrapeAllocationAt10000Ports bounds what a scrape of 10,000 idle TCP ports allocates
// (issue #39: 39 MB through the registry; the target is 10 MB for the whole scrape).
func TestScrapeAllocationAt10000Ports(t *testing.T) {
	src := manyPorts(10000)
	got := scrapeBytes(Handler(prometheus.NewRegistry(), src), 3)
	old := scrapeBytes(oldHandler(src), 1)
	t.Logf("bytes allocated per scrape of 10,000 ports: %d through the registry, %d by Handler", old, got)
	if got > 1<<20 {
		t.Errorf("a scrape of 10,000 ports allocated %d bytes, want at most 1 MiB (the registry: %d)", got, old)
	}
}

// BenchmarkScrape10000Ports scrapes 10,000 idle TCP ports (100,000 series) through the registry
// (before) and through Handler (after).
func BenchmarkScrape10000Ports(b *testing.B) {
	src := manyPorts(10000)
	for _, bc := range []struct {
		name string
		h    http.Handler
	}{
		{"registry", oldHandler(src)},
		{"handler", Handler(prometheus.NewRegistry(), src)},
	} {
		b.Run(bc.name, func(b *testing.B) {
			req := httptest.NewRequest(http.MethodGet, "/metrics", nil)
			w := &discard{h: http.Header{}}
			b.ReportAllocs()
			for b.Loop() {
				bc.h.ServeHTTP(w, req)
			}
		})
	}
}

func promhttpHandler(reg *prometheus.Registry) http.Handler {
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
}
