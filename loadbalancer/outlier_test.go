package loadbalancer

// Address plan: endpoints are 10.0.0.<n>:80 and clients 192.168.0.<n>; nothing is dialled, the
// test reports dial results itself as the proxies do.

import (
	"errors"
	"net/netip"
	"slices"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

var errRefused = errors.New("connection refused")

func outlierLB(t *testing.T, o service.Outlier, n int) (*LoadBalancer, *clocktesting.FakeClock, *[]Ejection) {
	t.Helper()
	lb, clk := newTestLB()
	var got []Ejection
	lb.OnEjection(func(e Ejection) { got = append(got, e) })
	lb.SetBalancing(foo, service.Balancing{Outlier: o})
	var eps []netip.AddrPort
	for i := 1; i <= n; i++ {
		eps = append(eps, ep(i, 80))
	}
	lb.SetEndpoints(foo, eps)
	return lb, clk, &got
}

// failDials reports k failed dials to ep (each after a pick of it, as a proxy would).
func failDials(lb *LoadBalancer, e netip.AddrPort, k int) {
	s := lb.Lookup(foo)
	for range k {
		s.take(s.eps.Load().get(e))
		s.DialDone(e, errRefused)
	}
}

func pickSet(t *testing.T, lb *LoadBalancer, n int) map[netip.AddrPort]int {
	t.Helper()
	out := map[netip.AddrPort]int{}
	for range n {
		got := mustNext(t, lb, foo, client(1), false)
		out[got]++
		lb.Lookup(foo).FlowDone(got, false)
	}
	return out
}

func TestOutlierEjection(t *testing.T) {
	three := service.Outlier{ConsecutiveFailures: 3, EjectionTime: 10 * time.Second, MaxEjectionPercent: 50}
	tests := []struct {
		name string
		o    service.Outlier
		n    int
		run  func(t *testing.T, lb *LoadBalancer, clk *clocktesting.FakeClock, ejections *[]Ejection)
	}{
		{"ejected_after_n_consecutive_failures_and_back_after_the_time", three, 3, func(t *testing.T, lb *LoadBalancer, clk *clocktesting.FakeClock, ej *[]Ejection) {
			failDials(lb, ep(1, 80), 2)
			if got := pickSet(t, lb, 6); got[ep(1, 80)] == 0 {
				t.Fatalf("picks %v: ejected after 2 of 3 failures", got)
			}
			failDials(lb, ep(1, 80), 1)
			if got := pickSet(t, lb, 6); got[ep(1, 80)] != 0 || got[ep(2, 80)] != 3 || got[ep(3, 80)] != 3 {
				t.Fatalf("picks %v: want only the other two while %v is ejected", got, ep(1, 80))
			}
			if len(*ej) != 1 || (*ej)[0].Endpoint != ep(1, 80) || (*ej)[0].Duration != 10*time.Second || (*ej)[0].Failures != 3 {
				t.Fatalf("ejections = %+v, want one of %v for 10s after 3 failures", *ej, ep(1, 80))
			}
			if total, out := lb.Lookup(foo).Outliers(); total != 1 || out != 1 {
				t.Errorf("Outliers() = %d, %d; want 1 ejection, 1 out", total, out)
			}
			clk.Step(10 * time.Second)
			if got := pickSet(t, lb, 6); got[ep(1, 80)] != 2 {
				t.Errorf("picks %v after the ejection time: want %v back in rotation", got, ep(1, 80))
			}
			if _, out := lb.Lookup(foo).Outliers(); out != 0 {
				t.Errorf("%d endpoints out after the ejection time, want 0", out)
			}
		}},
		{"a_success_breaks_the_streak", three, 3, func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock, ej *[]Ejection) {
			failDials(lb, ep(1, 80), 2)
			lb.Lookup(foo).DialDone(ep(1, 80), nil)
			failDials(lb, ep(1, 80), 2)
			if len(*ej) != 0 {
				t.Errorf("ejections = %+v, want none: the failures were not consecutive", *ej)
			}
		}},
		{"immediate_resets_count_too", three, 3, func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock, ej *[]Ejection) {
			s := lb.Lookup(foo)
			for range 3 { // connected, then reset before any reply
				s.take(s.eps.Load().get(ep(2, 80)))
				s.DialDone(ep(2, 80), nil)
				s.FlowDone(ep(2, 80), true)
			}
			if len(*ej) != 1 || (*ej)[0].Endpoint != ep(2, 80) || !(*ej)[0].Reset {
				t.Errorf("ejections = %+v, want %v ejected for resets", *ej, ep(2, 80))
			}
		}},
		{"back_off_grows_with_repeat_ejections_and_is_capped", service.Outlier{ConsecutiveFailures: 1, EjectionTime: time.Minute, MaxEjectionPercent: 50}, 2,
			func(t *testing.T, lb *LoadBalancer, clk *clocktesting.FakeClock, ej *[]Ejection) {
				var got []time.Duration
				for range 7 {
					failDials(lb, ep(1, 80), 1)
					d := (*ej)[len(*ej)-1].Duration
					got = append(got, d)
					clk.Step(d)
				}
				want := []time.Duration{time.Minute, 2 * time.Minute, 3 * time.Minute, 4 * time.Minute, 5 * time.Minute, 5 * time.Minute, 5 * time.Minute}
				if !slices.Equal(want, got) {
					t.Errorf("ejection times (-want +got)\n- %v\n+ %v", want, got)
				}
				// In rotation and succeeding for one ejection time: the multiplier starts over.
				clk.Step(time.Minute)
				lb.Lookup(foo).DialDone(ep(1, 80), nil)
				failDials(lb, ep(1, 80), 1)
				if d := (*ej)[len(*ej)-1].Duration; d != time.Minute {
					t.Errorf("ejection after a healthy spell lasts %v, want 1m", d)
				}
			}},
		{"never_more_than_max_ejection_percent", three, 4, func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock, ej *[]Ejection) {
			for i := 1; i <= 4; i++ {
				failDials(lb, ep(i, 80), 3)
			}
			if len(*ej) != 2 {
				t.Fatalf("ejections = %+v, want 2 (50%% of 4)", *ej)
			}
			if got := pickSet(t, lb, 8); got[ep(3, 80)] != 4 || got[ep(4, 80)] != 4 {
				t.Errorf("picks %v, want the two endpoints still in rotation", got)
			}
		}},
		{"a_lone_endpoint_is_never_ejected", three, 1, func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock, ej *[]Ejection) {
			failDials(lb, ep(1, 80), 10)
			if len(*ej) != 0 {
				t.Errorf("ejections = %+v, want none", *ej)
			}
		}},
		{"every_endpoint_out_means_all_serve", service.Outlier{ConsecutiveFailures: 1, EjectionTime: time.Minute, MaxEjectionPercent: 100}, 2,
			func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock, ej *[]Ejection) {
				failDials(lb, ep(1, 80), 1)
				failDials(lb, ep(2, 80), 1)
				if len(*ej) != 2 {
					t.Fatalf("ejections = %+v, want both", *ej)
				}
				if got := pickSet(t, lb, 4); got[ep(1, 80)] != 2 || got[ep(2, 80)] != 2 {
					t.Errorf("picks %v, want both (panic mode) rather than none", got)
				}
			}},
		{"off_when_unset", service.Outlier{}, 2, func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock, ej *[]Ejection) {
			failDials(lb, ep(1, 80), 100)
			if len(*ej) != 0 {
				t.Errorf("ejections = %+v, want none with outlier detection off", *ej)
			}
		}},
		{"turning_it_off_brings_everyone_back", three, 3, func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock, _ *[]Ejection) {
			failDials(lb, ep(1, 80), 3)
			lb.SetBalancing(foo, service.Balancing{})
			if got := pickSet(t, lb, 3); got[ep(1, 80)] != 1 {
				t.Errorf("picks %v, want %v back once detection is off", got, ep(1, 80))
			}
		}},
		{"affinity_moves_clients_off_an_ejected_endpoint", three, 3, func(t *testing.T, lb *LoadBalancer, clk *clocktesting.FakeClock, _ *[]Ejection) {
			lb.SetAffinity(foo, service.Affinity{ClientIP: true, Timeout: time.Hour})
			home := mustNext(t, lb, foo, client(9), false)
			failDials(lb, home, 3)
			moved := mustNext(t, lb, foo, client(9), false)
			if moved == home {
				t.Fatalf("client stayed on ejected %v", home)
			}
			clk.Step(time.Minute)
			if got := mustNext(t, lb, foo, client(9), false); got != moved {
				t.Errorf("client moved again to %v, want it to stay on %v", got, moved)
			}
		}},
		{"defaults_fill_in", service.Outlier{ConsecutiveFailures: 2}, 2, func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock, ej *[]Ejection) {
			o := lb.Lookup(foo).Balancing().Outlier
			if o.EjectionTime != service.DefaultEjectionTime || o.MaxEjectionPercent != service.DefaultMaxEjectionPercent {
				t.Errorf("outlier settings %+v, want the defaults filled in", o)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			lb, clk, ej := outlierLB(t, tc.o, tc.n)
			tc.run(t, lb, clk, ej)
		})
	}
}
