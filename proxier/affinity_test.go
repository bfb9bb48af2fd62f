package proxier

// Address plan: restore_test.go's (cluster IP 10.96.0.10, endpoints 10.244.2.x); clients
// 10.0.0.x. Sockets and portals are fakes.

import (
	"net/netip"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// TestInheritAffinity: a hand-over successor puts its predecessor's sticky clients into a port's
// balancer when the port's first endpoints are set (a Service that comes before its slices does
// not lose them), keeps only those of endpoints in use, and drops the rest at the first sync.
func TestInheritAffinity(t *testing.T) {
	e := newFakeEnv(t, nil)
	now := e.clk.Now()
	a, b := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
	gone := service.ServicePortName{Namespace: "ns", Name: "gone", Port: "http"}
	e.p.InheritAffinity(map[service.ServicePortName][]loadbalancer.AffinityEntry{
		webHTTP: {
			{Client: a, Endpoint: netip.MustParseAddrPort("10.244.2.3:8080"), LastUsed: now.Add(-time.Second)},
			{Client: b, Endpoint: netip.MustParseAddrPort("10.244.2.9:8080"), LastUsed: now}, // endpoint gone
		},
		gone: {{Client: a, Endpoint: netip.MustParseAddrPort("10.244.2.1:8080"), LastUsed: now}},
	})
	e.p.OnServiceAdd(webService(func(s *v1.Service) { s.Spec.SessionAffinity = v1.ServiceAffinityClientIP }))
	e.p.OnEndpointSliceAdd(webSlice("web-1", 8080, "10.244.2.1", "10.244.2.2", "10.244.2.3"))
	e.synced()
	e.sync()

	for i := range 5 {
		if ep, err := e.lb.Service(webHTTP).Next(a, false); err != nil || ep.String() != "10.244.2.3:8080" {
			t.Fatalf("pick %d of the inherited client: %v, %v; want its endpoint 10.244.2.3:8080", i, ep, err)
		}
	}
	if n := len(e.lb.Service(webHTTP).AffinityEntries()); n != 1 {
		t.Errorf("%d affinity entries; want the one inherited client (the other's endpoint is gone)", n)
	}
	if e.p.eps.inherited.pending != nil || e.p.eps.inherited.offered != 0 {
		t.Errorf("the inherited table outlived the first sync: %+v", e.p.eps.inherited)
	}
}
