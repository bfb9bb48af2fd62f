package proxier

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/metrics"
)

// BenchmarkTrafficScrape10000Ports measures one scrape of the traffic series at 10,000 open
// service ports (fake sockets keep no counters: the endpoints gauge of each port only).
func BenchmarkTrafficScrape10000Ports(b *testing.B) {
	e := newFakeEnv(b, nil)
	e.synced()
	addServices(e, 10000, sliceEP{addr: "10.244.0.1"})
	e.sync()
	c := metrics.NewTrafficCollector(e.p)
	ch := make(chan prometheus.Metric, 1024)
	done := make(chan int)
	go func() {
		n := 0
		for range ch {
			n++
		}
		done <- n
	}()
	b.ReportAllocs()
	for b.Loop() {
		c.Collect(ch)
	}
	close(ch)
	if n := <-done; n < 10000 {
		b.Fatalf("%d series, want at least 10000", n)
	}
}
