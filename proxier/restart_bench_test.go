package proxier

// Address plan: one namespace "node"; proxy ports 40000-49999 as an old process left them. No
// packet is sent: the benchmark measures only the reopen.

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/snapshot"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
)

// BenchmarkReopen10000 measures a restart's reopen of 10,000 TCP proxy ports on real sockets, with
// the restart snapshot's endpoints (the time from Restore to Serving), on each engine, in a
// namespace of its own.
func BenchmarkReopen10000(b *testing.B) {
	const n = 10000
	seeds := make([]Seed, n)
	st := &snapshot.State{Ports: make([]snapshot.Port, n)}
	for i := range seeds {
		seeds[i] = Seed{Name: service.ServicePortName{Namespace: "bulk", Name: fmt.Sprintf("s%d", i), Port: "http"},
			Protocol: service.TCP, ProxyPort: uint16(40000 + i), Families: []portal.Family{portal.IPv4}}
		st.Ports[i] = snapPort(seeds[i].Name, service.TCP, seeds[i].ProxyPort, "10.244.1.1:8080", "10.244.1.2:8080", "10.244.1.3:8080",
			"10.244.1.4:8080", "10.244.1.5:8080")
	}
	for _, engine := range []string{tcp.EngineEpoll, tcp.EngineIOUring} {
		b.Run(engine, func(b *testing.B) {
			e, _, err := tcp.ChooseEngine(engine, nil, logrus.New())
			if err != nil {
				b.Skip(err)
			}
			defer e.Close()
			node := netns.NewTestLab(b).MustAdd(b, "node")
			var total time.Duration
			runs := 0
			for b.Loop() {
				px := New(Config{PortRange: PortRange{Base: 40000, Size: n}}, Deps{Balancer: loadbalancer.New(nil), Portals: &recordingPortals{},
					Sockets: RealSockets(SocketConfig{TCP: tcp.Config{Engine: e}})})
				px.Reopen(seeds)
				start := time.Now()
				if r := px.Restore(st); r != n {
					b.Fatalf("restored %d of %d", r, n)
				}
				ctx, cancel := context.WithCancel(b.Context())
				done := make(chan error, 1)
				go func() { done <- node.Do(func() error { px.Run(ctx); return nil }) }()
				<-px.Serving()
				total += time.Since(start)
				runs++
				if r, _, _ := px.ReopenCounts(); r != n {
					b.Fatalf("reopened %d of %d", r, n)
				}
				cancel()
				if err := <-done; err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(total.Milliseconds())/float64(runs), "ms/reopen")
		})
	}
}
