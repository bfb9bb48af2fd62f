package tcp

import (
	"fmt"
	"net/netip"
	"runtime"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// BenchmarkProxyHeapPerPort reports the heap a listening proxy that has seen no connection holds
// (bytes/port): what 10,000 idle service ports cost the daemon in its proxy sockets. Each round
// opens 500 proxies on loopback with a config as the proxier's (logger, engine), on the epoll
// engine, and measures the live heap after a GC before and after.
func BenchmarkProxyHeapPerPort(b *testing.B) {
	const n = 500
	cfg := Config{Logger: testLogger(b)}
	var perPort float64
	for b.Loop() {
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
				b.Fatal(err)
			}
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		perPort = float64(after.HeapAlloc-before.HeapAlloc) / n
		for _, p := range proxies {
			p.Shutdown()
		}
		runtime.KeepAlive(proxies)
	}
	b.ReportMetric(perPort, "bytes/port")
}
