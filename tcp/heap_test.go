package tcp

import (
	"fmt"
	"net/netip"
	"runtime"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// idleProxyHeap opens n proxies on loopback (127.0.0.1, kernel-chosen ports) with a config as the
// proxier's (logger, engine: epoll), and returns the live heap they hold per proxy, measured after
// a GC before and after, with none of them having seen a connection.
func idleProxyHeap(tb testing.TB, n int) float64 {
	cfg := Config{Logger: testLogger(tb)}
	proxies := make([]*Proxy, n)
	names := make([]service.ServicePortName, n)
	for i := range names {
		names[i] = service.ServicePortName{Namespace: "ns", Name: fmt.Sprintf("s%d", i)}
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := range proxies {
		proxies[i] = New(names[i], &fakePicker{}, cfg)
		if err := proxies[i].Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
			tb.Fatal(err)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	perPort := float64(after.HeapAlloc-before.HeapAlloc) / float64(n)
	for _, p := range proxies {
		p.Shutdown()
	}
	runtime.KeepAlive(proxies)
	return perPort
}

// TestIdleProxyHeap: a listening proxy that has seen no connection holds no channel, context or
// counters (made at their first use): 10,000 idle service ports are a large part of the daemon's
// heap. 200 of them held 1031 bytes each with three channels and a context made in New, 600-630
// without.
func TestIdleProxyHeap(t *testing.T) {
	const limit = 850
	if got := idleProxyHeap(t, 200); got > limit {
		t.Errorf("an idle listening proxy holds %.0f heap bytes, want at most %d", got, limit)
	}
}

// BenchmarkProxyHeapPerPort reports the heap a listening proxy that has seen no connection holds
// (bytes/port): what 10,000 idle service ports cost the daemon in its proxy sockets. Each round
// opens 500 proxies.
func BenchmarkProxyHeapPerPort(b *testing.B) {
	var perPort float64
	for b.Loop() {
		perPort = idleProxyHeap(b, 500)
	}
	b.ReportMetric(perPort, "bytes/port")
}
