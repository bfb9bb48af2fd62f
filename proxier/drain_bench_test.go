package proxier

import (
	"testing"

	v1 "k8s.io/api/core/v1"
)

// BenchmarkEndpointChurn is the cost of one EndpointSlice update of a 1,000-endpoint TCP service
// whose socket is open, alternating between all endpoints and one fewer (an endpoint leaves and
// comes back), under each drain policy: none (the default), --drain-removed-endpoints, and a
// drain-timeout annotation (the endpoint's drain starts and is called off when it returns).
func BenchmarkEndpointChurn(b *testing.B) {
	for _, tc := range []struct {
		name  string
		flag  bool
		drain string
	}{{"default", false, ""}, {"flag", true, ""}, {"drain_timeout", false, "60s"}} {
		b.Run(tc.name, func(b *testing.B) {
			e := newFakeEnv(b, func(c *Config) { c.DrainTCP = tc.flag })
			e.synced()
			var mutate func(*v1.Service)
			if tc.drain != "" {
				mutate = annotated("portal-proxy.kubernetes.io/drain-timeout", tc.drain)
			}
			e.p.OnServiceAdd(webService(mutate))
			full := benchSlice(1000)
			less := benchSlice(1000)
			less.Endpoints = less.Endpoints[1:]
			e.p.OnEndpointSliceAdd(full)
			e.sync()
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				if i%2 == 0 {
					e.p.OnEndpointSliceUpdate(nil, less)
				} else {
					e.p.OnEndpointSliceUpdate(nil, full)
				}
				i++
			}
		})
	}
}
