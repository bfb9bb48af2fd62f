package loadbalancer

// Address plan: endpoints are 10.0.0.<n>:<port> and clients 192.168.0.<n>; nothing is dialled, the
// test reports flow ends itself as the proxies do.

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

func actives(lb *LoadBalancer, name service.ServicePortName) map[netip.AddrPort]int64 {
	out := map[netip.AddrPort]int64{}
	for _, st := range lb.Lookup(name).EndpointStates() {
		out[st.Endpoint] = st.Active
	}
	return out
}

func diffActives(want, got map[netip.AddrPort]int64) string {
	if fmt.Sprint(want) == fmt.Sprint(got) {
		return ""
	}
	return fmt.Sprintf("(-want +got)\n- %v\n+ %v", want, got)
}

func TestAlgorithms(t *testing.T) {
	three := []netip.AddrPort{ep(1, 80), ep(2, 80), ep(3, 80)}
	lc := service.Balancing{Algorithm: service.LeastConnections}
	p2c := service.Balancing{Algorithm: service.RandomTwoChoices}
	tests := []struct {
		name string
		run  func(t *testing.T, lb *LoadBalancer, clk *clocktesting.FakeClock)
	}{
		{"round_robin_is_the_default", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetEndpoints(foo, three)
			if got := lb.Lookup(foo).Balancing().Algorithm; got != service.RoundRobin {
				t.Errorf("algorithm = %q, want round-robin", got)
			}
			// Busy endpoints do not matter to round robin.
			mustNext(t, lb, foo, client(1), false)
			if d := diffEPs([]netip.AddrPort{ep(2, 80), ep(3, 80), ep(1, 80)}, picks(t, lb, foo, client(1), 3)); d != "" {
				t.Error(d)
			}
		}},
		{"least_connections_picks_the_fewest_live_flows", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetBalancing(foo, lc)
			lb.SetEndpoints(foo, three)
			s := lb.Lookup(foo)
			for range 6 { // two each: ties go round the endpoints
				mustNext(t, lb, foo, client(1), false)
			}
			if d := diffActives(map[netip.AddrPort]int64{ep(1, 80): 2, ep(2, 80): 2, ep(3, 80): 2}, actives(lb, foo)); d != "" {
				t.Fatal(d)
			}
			s.DialDone(ep(2, 80), nil) // connected: still counted
			s.FlowDone(ep(2, 80), false)
			if got := mustNext(t, lb, foo, client(1), false); got != ep(2, 80) { // 1 flow against 2 and 2
				t.Errorf("picked %v, want %v, the endpoint with the fewest flows", got, ep(2, 80))
			}
		}},
		{"a_failed_dial_releases_its_flow", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetBalancing(foo, lc)
			lb.SetEndpoints(foo, three)
			got := mustNext(t, lb, foo, client(1), false)
			lb.Lookup(foo).DialDone(got, fmt.Errorf("connection refused"))
			if d := diffActives(map[netip.AddrPort]int64{ep(1, 80): 0, ep(2, 80): 0, ep(3, 80): 0}, actives(lb, foo)); d != "" {
				t.Error(d)
			}
		}},
		{"counts_never_go_negative", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			// A flow picked before its endpoint was removed and re-added ends on a fresh entry.
			lb.SetEndpoints(foo, three)
			lb.Lookup(foo).FlowDone(ep(1, 80), false)
			if got := actives(lb, foo)[ep(1, 80)]; got != 0 {
				t.Errorf("active = %d after an unmatched end, want 0", got)
			}
		}},
		{"counts_survive_endpoint_updates", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetBalancing(foo, lc)
			lb.SetEndpoints(foo, three[:1])
			mustNext(t, lb, foo, client(1), false)
			lb.SetEndpoints(foo, three)
			if d := diffActives(map[netip.AddrPort]int64{ep(1, 80): 1, ep(2, 80): 0, ep(3, 80): 0}, actives(lb, foo)); d != "" {
				t.Error(d)
			}
			// The next two go to the idle newcomers.
			a, b := mustNext(t, lb, foo, client(1), false), mustNext(t, lb, foo, client(1), false)
			if a == ep(1, 80) || b == ep(1, 80) || a == b {
				t.Errorf("picked %v, %v; want the two idle endpoints", a, b)
			}
		}},
		{"random_two_choices_never_picks_the_busiest", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetBalancing(foo, p2c)
			lb.SetEndpoints(foo, three)
			s := lb.Lookup(foo)
			busy := ep(3, 80)
			for range 5 {
				s.take(s.eps.Load().get(busy))
			}
			seen := map[netip.AddrPort]int{}
			for range 300 {
				got := mustNext(t, lb, foo, client(1), false)
				seen[got]++
				s.FlowDone(got, false) // short flows: counts stay 0, 0, 5
			}
			if seen[busy] != 0 || seen[ep(1, 80)] == 0 || seen[ep(2, 80)] == 0 {
				t.Errorf("picks = %v; want both idle endpoints and never the busy one", seen)
			}
		}},
		{"random_two_choices_with_one_endpoint", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetBalancing(foo, p2c)
			lb.SetEndpoints(foo, three[:1])
			if got := mustNext(t, lb, foo, client(1), true); got != ep(1, 80) {
				t.Errorf("picked %v, want the only endpoint", got)
			}
		}},
		{"affinity_keeps_working_on_least_connections", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetBalancing(foo, lc)
			lb.SetAffinity(foo, service.Affinity{ClientIP: true, Timeout: time.Minute})
			lb.SetEndpoints(foo, three)
			home := mustNext(t, lb, foo, client(1), false)
			for range 3 { // client 1 stays although its endpoint is now the busiest
				if got := mustNext(t, lb, foo, client(1), false); got != home {
					t.Fatalf("client 1 moved from %v to %v", home, got)
				}
			}
			// A new client goes to an idle endpoint; a retry moves client 1 off its endpoint.
			if got := mustNext(t, lb, foo, client(2), false); got == home {
				t.Errorf("client 2 joined the busiest endpoint %v", home)
			}
			moved := mustNext(t, lb, foo, client(1), true)
			if moved == home {
				t.Errorf("reset kept client 1 on %v", home)
			}
			if got := mustNext(t, lb, foo, client(1), false); got != moved {
				t.Errorf("client 1 did not stick to its new endpoint %v (got %v)", moved, got)
			}
		}},
		{"affinity_keeps_working_on_random_two_choices", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetBalancing(foo, p2c)
			lb.SetAffinity(foo, service.Affinity{ClientIP: true, Timeout: time.Minute})
			lb.SetEndpoints(foo, three)
			home := mustNext(t, lb, foo, client(1), false)
			for range 20 {
				if got := mustNext(t, lb, foo, client(1), false); got != home {
					t.Fatalf("client 1 moved from %v to %v", home, got)
				}
			}
			for range 20 {
				if got := mustNext(t, lb, foo, client(1), true); got == home {
					t.Fatalf("reset picked the sticky endpoint %v again", home)
				} else {
					home = got
				}
			}
		}},
		{"switching_back_to_round_robin", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetBalancing(foo, lc)
			lb.SetEndpoints(foo, three)
			lb.SetBalancing(foo, service.Balancing{})
			if got := lb.Lookup(foo).Balancing().Algorithm; got != service.RoundRobin {
				t.Errorf("algorithm = %q, want round-robin", got)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			lb, clk := newTestLB()
			tc.run(t, lb, clk)
		})
	}
}
