package loadbalancer

// Address plan: endpoints are 10.0.0.<n>:80, clients 192.168.0.<n>; nothing is dialled.

import (
	"net/netip"
	"testing"
	"time"

	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// TestNextWhy: a pick explains itself with the algorithm in force and the reasons that apply.
func TestNextWhy(t *testing.T) {
	client := netip.MustParseAddr("192.168.0.1")
	three := []netip.AddrPort{ep(1, 80), ep(2, 80), ep(3, 80)}
	tests := []struct {
		name  string
		setup func(lb *LoadBalancer)
		reset bool
		want  flow.Pick
	}{
		{"round_robin", func(lb *LoadBalancer) {}, false, flow.Pick{Algorithm: flow.RoundRobin}},
		{"least_connections", func(lb *LoadBalancer) {
			lb.SetBalancing(foo, service.Balancing{Algorithm: service.LeastConnections})
		}, false, flow.Pick{Algorithm: flow.LeastConnections}},
		{"random_two_choices", func(lb *LoadBalancer) {
			lb.SetBalancing(foo, service.Balancing{Algorithm: service.RandomTwoChoices})
		}, false, flow.Pick{Algorithm: flow.Random}},
		{"retry", func(lb *LoadBalancer) {}, true, flow.Pick{Why: flow.Retry}},
		{"affinity_reused", func(lb *LoadBalancer) {
			lb.SetAffinity(foo, service.Affinity{ClientIP: true, Timeout: time.Hour})
			if _, err := lb.NextEndpoint(foo, client, false); err != nil { // makes the entry
				t.Fatal(err)
			}
		}, false, flow.Pick{Why: flow.Affinity}},
		{"affinity_first_pick_is_the_algorithm's", func(lb *LoadBalancer) {
			lb.SetAffinity(foo, service.Affinity{ClientIP: true, Timeout: time.Hour})
		}, false, flow.Pick{}},
		{"set_reasons_are_ored_in", func(lb *LoadBalancer) {
			lb.SetPickWhy(foo, flow.Topology|flow.Terminating)
		}, true, flow.Pick{Why: flow.Topology | flow.Terminating | flow.Retry}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			lb, _ := newTestLB()
			lb.SetEndpoints(foo, three)
			tt.setup(lb)
			got, pick, err := lb.Lookup(foo).NextWhy(client, tt.reset)
			if err != nil || !got.IsValid() {
				t.Fatalf("NextWhy = %v, %v", got, err)
			}
			if pick != tt.want {
				t.Errorf("NextWhy pick %+v, want %+v", pick, tt.want)
			}
		})
	}
	t.Run("slow_start", func(t *testing.T) {
		lb, _ := newTestLB()
		lb.SetBalancing(foo, service.Balancing{SlowStart: time.Hour})
		lb.SetEndpoints(foo, three[:1])
		lb.SetEndpoints(foo, three[:2]) // ep 2 warms up
		for range 1000 {
			got, pick, err := lb.Lookup(foo).NextWhy(client, false)
			if err != nil {
				t.Fatal(err)
			}
			if want := got == ep(2, 80); (pick.Why&flow.SlowStart != 0) != want {
				t.Fatalf("pick of %s: %+v; slow start %v expected", got, pick, want)
			}
			if got == ep(2, 80) {
				return
			}
		}
		t.Fatal("the warming endpoint was never picked")
	})
	t.Run("no_endpoints", func(t *testing.T) {
		lb, _ := newTestLB()
		if _, _, err := lb.Service(foo).NextWhy(client, false); err == nil {
			t.Fatal("NextWhy without endpoints did not fail")
		}
	})
}

// TestEndpointRefs: a pick names the chosen endpoint's pod and node as set, an endpoint that
// stays keeps its name across endpoint updates, a renamed one gets its new name, and one the
// proxier cannot name has none.
func TestEndpointRefs(t *testing.T) {
	lb := New(clock.RealClock{})
	client := netip.MustParseAddr("192.168.0.1")
	names := map[netip.AddrPort]*flow.EndpointRef{
		ep(1, 80): {Pod: "ns/web-1", Node: "node-a"},
		ep(2, 80): {Pod: "ns/web-2", Node: "node-b"},
	}
	refOf := func(a netip.AddrPort) *flow.EndpointRef {
		if r := names[a]; r != nil {
			c := *r
			return &c
		}
		return nil
	}
	pickRefs := func(n int) map[netip.AddrPort]*flow.EndpointRef {
		got := map[netip.AddrPort]*flow.EndpointRef{}
		for range n {
			a, pick, err := lb.Service(foo).NextWhy(client, false)
			if err != nil {
				t.Fatal(err)
			}
			got[a] = pick.Ref
		}
		return got
	}
	lb.SetEndpoints(foo, []netip.AddrPort{ep(1, 80), ep(2, 80), ep(3, 80)})
	lb.SetEndpointRefs(foo, refOf)
	got := pickRefs(3)
	for a, want := range map[netip.AddrPort]string{ep(1, 80): "ns/web-1@node-a", ep(2, 80): "ns/web-2@node-b", ep(3, 80): ""} {
		r := got[a]
		if (r == nil) != (want == "") || (r != nil && r.Pod+"@"+r.Node != want) {
			t.Errorf("pick of %v named %+v, want %q", a, r, want)
		}
	}
	first := got[ep(1, 80)]

	// web-2 moves to another node; web-1 stays as it was and keeps the very same ref.
	names[ep(2, 80)] = &flow.EndpointRef{Pod: "ns/web-2", Node: "node-c"}
	lb.SetEndpoints(foo, []netip.AddrPort{ep(1, 80), ep(2, 80)})
	lb.SetEndpointRefs(foo, refOf)
	got = pickRefs(2)
	if got[ep(1, 80)] != first {
		t.Errorf("web-1's ref changed across an update that kept it: %p, then %p", first, got[ep(1, 80)])
	}
	if r := got[ep(2, 80)]; r == nil || r.Node != "node-c" {
		t.Errorf("web-2 named %+v after its move, want node-c", r)
	}
}
