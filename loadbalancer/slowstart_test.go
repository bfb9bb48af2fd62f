package loadbalancer

// Address plan: endpoints are 10.0.0.<n>:80, the client 192.168.0.1; nothing is dialled.

import (
	"math"
	"net/netip"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// shareOf makes n short picks (each flow ends at once) and returns newcomer's picks divided by
// the mean picks of the other endpoints: its weight relative to a warm endpoint.
func shareOf(t *testing.T, lb *LoadBalancer, newcomer netip.AddrPort, n int) float64 {
	t.Helper()
	got := pickSet(t, lb, n)
	others, k := 0, 0
	for e, c := range got {
		if e != newcomer {
			others += c
			k++
		}
	}
	if k == 0 || others == 0 {
		return math.Inf(1)
	}
	return float64(got[newcomer]) / (float64(others) / float64(k))
}

func TestSlowStart(t *testing.T) {
	const window = 100 * time.Second
	three := []netip.AddrPort{ep(1, 80), ep(2, 80), ep(3, 80)}
	four := append(three[:3:3], ep(4, 80))
	near := func(t *testing.T, what string, got, want float64) {
		t.Helper()
		if math.Abs(got-want) > 0.08 {
			t.Errorf("%s: share %.3f of a warm endpoint's, want %.2f±0.08", what, got, want)
		}
	}
	tests := []struct {
		name string
		b    service.Balancing
		run  func(t *testing.T, lb *LoadBalancer, clk *clocktesting.FakeClock)
	}{
		{"new_endpoint_ramps_up_linearly_round_robin", service.Balancing{SlowStart: window}, func(t *testing.T, lb *LoadBalancer, clk *clocktesting.FakeClock) {
			lb.SetEndpoints(foo, three)
			lb.SetEndpoints(foo, four)
			near(t, "at 0s", shareOf(t, lb, ep(4, 80), 8000), minWarmWeight)
			clk.Step(window / 4)
			near(t, "at 25s", shareOf(t, lb, ep(4, 80), 8000), 0.25)
			clk.Step(window / 4)
			near(t, "at 50s", shareOf(t, lb, ep(4, 80), 8000), 0.5)
			clk.Step(window / 4)
			near(t, "at 75s", shareOf(t, lb, ep(4, 80), 8000), 0.75)
			clk.Step(window / 4)
			if got := shareOf(t, lb, ep(4, 80), 400); got != 1 {
				t.Errorf("after the window: share %.3f, want exactly 1 (plain round robin again)", got)
			}
			if lb.Lookup(foo).warmHint.Load() != 0 {
				t.Error("the warm-up hint stays set after every endpoint is warm: picks keep reading the clock")
			}
		}},
		{"new_endpoint_ramps_up_random_two_choices", service.Balancing{SlowStart: window, Algorithm: service.RandomTwoChoices}, func(t *testing.T, lb *LoadBalancer, clk *clocktesting.FakeClock) {
			lb.SetEndpoints(foo, three)
			lb.SetEndpoints(foo, four)
			s := lb.Lookup(foo)
			// Flows held open: the newcomer gets flows until its load per weight matches.
			held := func(n int) map[netip.AddrPort]int {
				out := map[netip.AddrPort]int{}
				for range n {
					out[mustNext(t, lb, foo, client(1), false)]++
				}
				return out
			}
			got := held(120)
			if got[ep(4, 80)] > 5 {
				t.Errorf("at 0s the newcomer took %d of 120 held flows (%v), want at most 5", got[ep(4, 80)], got)
			}
			for e, c := range got { // end them all
				for range c {
					s.FlowDone(e, false)
				}
			}
			clk.Step(window)
			if got := held(120); got[ep(4, 80)] < 25 {
				t.Errorf("after the window the newcomer took %d of 120 held flows (%v), want its fair ~30", got[ep(4, 80)], got)
			}
		}},
		{"new_endpoint_ramps_up_least_connections", service.Balancing{SlowStart: window, Algorithm: service.LeastConnections}, func(t *testing.T, lb *LoadBalancer, clk *clocktesting.FakeClock) {
			lb.SetEndpoints(foo, three)
			lb.SetEndpoints(foo, four)
			held := map[netip.AddrPort]int{}
			for range 40 {
				held[mustNext(t, lb, foo, client(1), false)]++
			}
			// Balanced when (flows+1)/weight match: 12 or so each for the warm ones, 0-1 for
			// the newcomer at weight 0.1.
			if held[ep(4, 80)] > 1 {
				t.Errorf("at 0s the newcomer holds %d of 40 flows (%v), want at most 1", held[ep(4, 80)], held)
			}
			clk.Step(window / 2) // weight 0.5: it catches up to half the others' load
			for range 20 {
				held[mustNext(t, lb, foo, client(1), false)]++
			}
			// (n+1)/0.5 against (17+1)/1 for the others: n is 8 or 9.
			if n := held[ep(4, 80)]; n < 7 || n > 10 {
				t.Errorf("at 50s the newcomer holds %d of 60 flows (%v), want 7-10 (about half the others' 17)", n, held)
			}
		}},
		{"first_endpoints_take_traffic_at_once", service.Balancing{SlowStart: window}, func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetEndpoints(foo, four)
			if got := shareOf(t, lb, ep(4, 80), 400); got != 1 {
				t.Errorf("share %.3f, want 1: a first endpoint set does not warm up", got)
			}
		}},
		{"off_by_default", service.Balancing{}, func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetEndpoints(foo, three)
			lb.SetEndpoints(foo, four)
			if got := shareOf(t, lb, ep(4, 80), 400); got != 1 {
				t.Errorf("share %.3f, want 1 without slow start", got)
			}
		}},
		{"an_endpoint_back_from_ejection_warms_up", service.Balancing{SlowStart: window,
			Outlier: service.Outlier{ConsecutiveFailures: 1, EjectionTime: time.Minute, MaxEjectionPercent: 50}},
			func(t *testing.T, lb *LoadBalancer, clk *clocktesting.FakeClock) {
				lb.SetEndpoints(foo, four)
				failDials(lb, ep(4, 80), 1)
				if got := shareOf(t, lb, ep(4, 80), 400); got != 0 {
					t.Fatalf("share %.3f while ejected, want 0", got)
				}
				clk.Step(time.Minute)
				near(t, "just back", shareOf(t, lb, ep(4, 80), 8000), minWarmWeight)
				clk.Step(window / 2)
				near(t, "half a window later", shareOf(t, lb, ep(4, 80), 8000), 0.5)
			}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			lb, clk := newTestLB()
			lb.SetBalancing(foo, tc.b)
			tc.run(t, lb, clk)
		})
	}
}
