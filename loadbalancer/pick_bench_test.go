package loadbalancer

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// BenchmarkPick is the balancer's cost per connection for each algorithm, alone and with outlier
// detection and slow start on, side by side in one run with plain round robin: a pick, and the
// proxies' reports of the dial and the flow's end. A steady 3 flows per endpoint stay open, so
// least-connections compares real counts; with slow start one endpoint warms up all along.
func BenchmarkPick(b *testing.B) {
	for _, nEps := range []int{3, 100} {
		eps := make([]netip.AddrPort, nEps)
		for i := range eps {
			eps[i] = netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, byte(i / 250), byte(i%250 + 1)}), 8080)
		}
		for _, pol := range benchPolicies() {
			algo := pol.bal.Algorithm
			setup := func() *Service {
				lb := New(clock.RealClock{})
				lb.SetBalancing(foo, pol.bal)
				if pol.bal.SlowStart > 0 {
					// The last endpoint is new, so it warms up for the whole run (the pick weighs).
					lb.SetEndpoints(foo, eps[:nEps-1])
				}
				lb.SetEndpoints(foo, eps)
				s := lb.Lookup(foo)
				for range 3 * nEps {
					_, _ = s.Next(netip.Addr{}, false)
				}
				return s
			}
			name := fmt.Sprintf("eps=%d/%s%s", nEps, algo, pol.suffix)
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

type benchPolicy struct {
	suffix string
	bal    service.Balancing
}

// benchPolicies is every algorithm plain, then with outlier detection, slow start, and both.
func benchPolicies() []benchPolicy {
	outlier := service.Outlier{ConsecutiveFailures: 3, EjectionTime: 30 * time.Second, MaxEjectionPercent: 50}
	var out []benchPolicy
	for _, extra := range []benchPolicy{
		{"", service.Balancing{}},
		{"+outlier", service.Balancing{Outlier: outlier}},
		{"+slow-start", service.Balancing{SlowStart: time.Hour}},
		{"+outlier+slow-start", service.Balancing{Outlier: outlier, SlowStart: time.Hour}},
	} {
		for _, algo := range []service.Algorithm{service.RoundRobin, service.LeastConnections, service.RandomTwoChoices} {
			b := extra.bal
			b.Algorithm = algo
			out = append(out, benchPolicy{extra.suffix, b})
		}
	}
	return out
}
