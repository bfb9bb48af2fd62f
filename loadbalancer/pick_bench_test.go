package loadbalancer

import (
	"fmt"
	"net/netip"
	"testing"

	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// BenchmarkPick is the balancer's cost per connection for each algorithm, side by side in one
// run: a pick, and the proxies' reports of the dial and the flow's end. A steady 3 flows per
// endpoint stay open, so least-connections compares real counts.
func BenchmarkPick(b *testing.B) {
	for _, nEps := range []int{3, 100} {
		eps := make([]netip.AddrPort, nEps)
		for i := range eps {
			eps[i] = netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, byte(i / 250), byte(i%250 + 1)}), 8080)
		}
		for _, algo := range []service.Algorithm{service.RoundRobin, service.LeastConnections, service.RandomTwoChoices} {
			setup := func() *Service {
				lb := New(clock.RealClock{})
				lb.SetBalancing(foo, service.Balancing{Algorithm: algo})
				lb.SetEndpoints(foo, eps)
				s := lb.Lookup(foo)
				for range 3 * nEps {
					_, _ = s.Next(netip.Addr{}, false)
				}
				return s
			}
			name := fmt.Sprintf("eps=%d/%s", nEps, algo)
			b.Run(name, func(b *testing.B) {
				s := setup()
				b.ReportAllocs()
				for b.Loop() {
					ep, err := s.Next(netip.Addr{}, false)
					if err != nil {
						b.Fatal(err)
					}
					s.DialDone(ep, nil)
					s.FlowDone(ep, false)
				}
			})
			b.Run(name+"/parallel", func(b *testing.B) {
				s := setup()
				b.ReportAllocs()
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						ep, err := s.Next(netip.Addr{}, false)
						if err != nil {
							b.Error(err)
							return
						}
						s.DialDone(ep, nil)
						s.FlowDone(ep, false)
					}
				})
			})
		}
	}
}
