package proxier

// Address plan: 1,000 endpoints 10.244.x.y:8080 spread over 3 zones and 100 nodes, each slice
// endpoint hinted for its own zone (what PreferSameZone publishes). No traffic.

import (
	"fmt"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

func benchSlice(n int) *discovery.EndpointSlice {
	s := makeSlice("ns", "web", "a", discovery.AddressTypeIPv4, []discovery.EndpointPort{slicePortOf("http", v1.ProtocolTCP, 8080)})
	for i := range n {
		zone := fmt.Sprintf("zone-%d", i%3)
		s.Endpoints = append(s.Endpoints, discovery.Endpoint{
			Addresses: []string{fmt.Sprintf("10.244.%d.%d", i/250, i%250+1)},
			NodeName:  ptr(fmt.Sprintf("node-%d", i%100)), Zone: ptr(zone),
			Hints:     &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: zone}}},
			TargetRef: &v1.ObjectReference{Kind: "Pod", Name: fmt.Sprintf("web-%d", i)},
		})
	}
	return s
}

// BenchmarkConvertSlice is the per-event conversion cost of a full 1,000-endpoint slice.
func BenchmarkConvertSlice(b *testing.B) {
	s := benchSlice(1000)
	b.ReportAllocs()
	for b.Loop() {
		convertSlice(s)
	}
}

// BenchmarkSelectEndpoints is the selection cost for one port of 1,000 endpoints, both policies
// in use (so both sets are computed).
func BenchmarkSelectEndpoints(b *testing.B) {
	port := &service.Port{Name: service.ServicePortName{Namespace: "ns", Name: "web", Port: "http"}, Protocol: service.TCP,
		ClusterIPs: addrs("10.96.0.10"), NodePort: 30080, ExternalLocal: true}
	eps := endpointsFor(port, []*slimSlice{convertSlice(benchSlice(1000))})
	node := NodeTopology{Name: "node-7", Zone: "zone-1"}
	if got := selectEndpoints(port, eps, node); len(got.Internal.Endpoints) != 333 || len(got.External.Endpoints) != 10 {
		b.Fatalf("selection %d internal / %d external endpoints, want 333 / 10", len(got.Internal.Endpoints), len(got.External.Endpoints))
	}
	b.ReportAllocs()
	for b.Loop() {
		selectEndpoints(port, eps, node)
	}
}
