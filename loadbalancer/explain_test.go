package loadbalancer

// Address plan: endpoints are 10.0.0.<n>:80, clients 192.168.0.<n>; nothing is dialled.

import (
	"net/netip"
	"testing"
	"time"

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
