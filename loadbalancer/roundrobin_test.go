package loadbalancer

// Address plan: endpoints are 10.0.0.<n>:<port> and clients 192.168.0.<n>; nothing is dialled, the
// balancer only returns addresses.

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/utils/clock"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

var (
	foo  = service.ServicePortName{Namespace: "default", Name: "foo", Port: "p"}
	fooQ = service.ServicePortName{Namespace: "default", Name: "foo", Port: "q"}
	bar  = service.ServicePortName{Namespace: "default", Name: "bar", Port: "p"}
)

func ep(n, port int) netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, 0, byte(n)}), uint16(port))
}

func client(n int) netip.Addr { return netip.AddrFrom4([4]byte{192, 168, 0, byte(n)}) }

// newTestLB returns a balancer that keeps endpoint order (no shuffle) so picks are predictable.
func newTestLB() (*LoadBalancer, *clocktesting.FakeClock) {
	clk := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	lb := New(clk)
	lb.shuffle = func([]netip.AddrPort) {}
	return lb, clk
}

func mustNext(t *testing.T, lb *LoadBalancer, name service.ServicePortName, c netip.Addr, reset bool) netip.AddrPort {
	t.Helper()
	got, err := lb.NextEndpoint(name, c, reset)
	if err != nil {
		t.Fatalf("NextEndpoint(%s, %s, reset=%v): %v", name, c, reset, err)
	}
	return got
}

// picks returns n consecutive picks for one client.
func picks(t *testing.T, lb *LoadBalancer, name service.ServicePortName, c netip.Addr, n int) []netip.AddrPort {
	t.Helper()
	out := make([]netip.AddrPort, n)
	for i := range out {
		out[i] = mustNext(t, lb, name, c, false)
	}
	return out
}

func diffEPs(want, got []netip.AddrPort) string {
	if slices.Equal(want, got) {
		return ""
	}
	return fmt.Sprintf("(-want +got)\n- %v\n+ %v", want, got)
}

func TestRoundRobin(t *testing.T) {
	tests := []struct {
		name string
		run  func(t *testing.T, lb *LoadBalancer)
	}{
		{"fails_with_no_service", func(t *testing.T, lb *LoadBalancer) {
			got, err := lb.NextEndpoint(foo, client(1), false)
			if !errors.Is(err, ErrMissingService) || got.IsValid() {
				t.Fatalf("got %v, %v; want invalid endpoint and ErrMissingService", got, err)
			}
		}},
		{"fails_with_no_endpoints", func(t *testing.T, lb *LoadBalancer) {
			lb.SetEndpoints(foo, nil)
			if _, err := lb.NextEndpoint(foo, client(1), false); !errors.Is(err, ErrNoEndpoints) {
				t.Fatalf("err = %v, want ErrNoEndpoints", err)
			}
		}},
		{"single_endpoint", func(t *testing.T, lb *LoadBalancer) {
			lb.SetEndpoints(foo, []netip.AddrPort{ep(1, 40)})
			want := []netip.AddrPort{ep(1, 40), ep(1, 40), ep(1, 40)}
			if d := diffEPs(want, picks(t, lb, foo, client(1), 3)); d != "" {
				t.Error(d)
			}
		}},
		{"multiple_endpoints_wrap", func(t *testing.T, lb *LoadBalancer) {
			lb.SetEndpoints(foo, []netip.AddrPort{ep(1, 40), ep(2, 40), ep(3, 40)})
			want := []netip.AddrPort{ep(1, 40), ep(2, 40), ep(3, 40), ep(1, 40)}
			if d := diffEPs(want, picks(t, lb, foo, client(1), 4)); d != "" {
				t.Error(d)
			}
		}},
		{"duplicates_ignored", func(t *testing.T, lb *LoadBalancer) {
			lb.SetEndpoints(foo, []netip.AddrPort{ep(1, 40), ep(1, 40), ep(2, 40)})
			want := []netip.AddrPort{ep(1, 40), ep(2, 40), ep(1, 40)}
			if d := diffEPs(want, picks(t, lb, foo, client(1), 3)); d != "" {
				t.Error(d)
			}
		}},
		{"ports_are_independent", func(t *testing.T, lb *LoadBalancer) {
			lb.SetEndpoints(foo, []netip.AddrPort{ep(1, 1), ep(3, 3)})
			lb.SetEndpoints(fooQ, []netip.AddrPort{ep(2, 2), ep(4, 4)})
			if d := diffEPs([]netip.AddrPort{ep(1, 1), ep(3, 3), ep(1, 1)}, picks(t, lb, foo, client(1), 3)); d != "" {
				t.Errorf("port p: %s", d)
			}
			if d := diffEPs([]netip.AddrPort{ep(2, 2), ep(4, 4), ep(2, 2)}, picks(t, lb, fooQ, client(1), 3)); d != "" {
				t.Errorf("port q: %s", d)
			}
		}},
		{"update_replaces_list_and_empty_fails", func(t *testing.T, lb *LoadBalancer) {
			lb.SetEndpoints(foo, []netip.AddrPort{ep(1, 1), ep(2, 2), ep(3, 3)})
			picks(t, lb, foo, client(1), 2)
			lb.SetEndpoints(foo, []netip.AddrPort{ep(4, 4), ep(5, 5)})
			got := picks(t, lb, foo, client(1), 4)
			if n := countOf(got, ep(4, 4)); n != 2 {
				t.Errorf("after update picks = %v, want each new endpoint twice", got)
			}
			if n := countOf(got, ep(5, 5)); n != 2 {
				t.Errorf("after update picks = %v, want each new endpoint twice", got)
			}
			lb.SetEndpoints(foo, nil)
			if _, err := lb.NextEndpoint(foo, client(1), false); !errors.Is(err, ErrNoEndpoints) {
				t.Fatalf("after update to empty: err = %v, want ErrNoEndpoints", err)
			}
		}},
		{"same_members_update_keeps_order", func(t *testing.T, lb *LoadBalancer) {
			lb.SetEndpoints(foo, []netip.AddrPort{ep(1, 1), ep(2, 2)})
			first := mustNext(t, lb, foo, client(1), false)
			lb.SetEndpoints(foo, []netip.AddrPort{ep(2, 2), ep(1, 1)})
			if second := mustNext(t, lb, foo, client(1), false); second == first {
				t.Errorf("an update with the same members restarted round robin: %v twice", first)
			}
		}},
		{"service_removal_leaves_others", func(t *testing.T, lb *LoadBalancer) {
			lb.SetEndpoints(foo, []netip.AddrPort{ep(1, 1), ep(2, 2)})
			lb.SetEndpoints(bar, []netip.AddrPort{ep(3, 3), ep(4, 4), ep(5, 5)})
			mustNext(t, lb, bar, client(1), false)
			lb.SetEndpoints(foo, nil)
			if _, err := lb.NextEndpoint(foo, client(1), false); !errors.Is(err, ErrNoEndpoints) {
				t.Errorf("foo: err = %v, want ErrNoEndpoints", err)
			}
			if d := diffEPs([]netip.AddrPort{ep(4, 4), ep(5, 5), ep(3, 3)}, picks(t, lb, bar, client(1), 3)); d != "" {
				t.Errorf("bar did not continue where it left off: %s", d)
			}
			lb.DeleteService(foo)
			if _, err := lb.NextEndpoint(foo, client(1), false); !errors.Is(err, ErrMissingService) {
				t.Errorf("deleted foo: err = %v, want ErrMissingService", err)
			}
		}},
		{"fair_across_updates", func(t *testing.T, lb *LoadBalancer) {
			// Endpoints churn after every pick: a balancer that restarts at index 0 would send every
			// pick to the first endpoint.
			counts := map[netip.AddrPort]int{}
			for i := range 100 {
				lb.SetEndpoints(foo, []netip.AddrPort{ep(1, 1), ep(2, 2), ep(100+i%2, 9)})
				counts[mustNext(t, lb, foo, client(1), false)]++
			}
			if counts[ep(1, 1)] > 40 || counts[ep(2, 2)] > 40 {
				t.Errorf("picks under churn = %v, want the stable endpoints near a third each", counts)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			lb, _ := newTestLB()
			tc.run(t, lb)
		})
	}
}

func countOf(eps []netip.AddrPort, want netip.AddrPort) int {
	n := 0
	for _, e := range eps {
		if e == want {
			n++
		}
	}
	return n
}

func TestAffinity(t *testing.T) {
	three := []netip.AddrPort{ep(1, 40), ep(2, 40), ep(3, 40)}
	clientIP := service.Affinity{ClientIP: true}
	tests := []struct {
		name string
		run  func(t *testing.T, lb *LoadBalancer, clk *clocktesting.FakeClock)
	}{
		{"sticks_service_first", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetAffinity(foo, clientIP)
			lb.SetEndpoints(foo, three)
			assertSticky(t, lb, foo, 3)
		}},
		{"sticks_endpoints_first", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetEndpoints(foo, three)
			lb.SetAffinity(foo, clientIP)
			assertSticky(t, lb, foo, 3)
		}},
		{"source_port_does_not_matter", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			// Affinity is keyed by IP only: the caller passes the address without a port.
			lb.SetAffinity(foo, clientIP)
			lb.SetEndpoints(foo, three)
			first := mustNext(t, lb, foo, client(7), false)
			mustNext(t, lb, foo, client(8), false)
			if got := mustNext(t, lb, foo, client(7), false); got != first {
				t.Errorf("client 7 moved from %v to %v", first, got)
			}
		}},
		{"remove_one_rehomes_only_its_clients", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetAffinity(foo, clientIP)
			lb.SetEndpoints(foo, three)
			home := map[int]netip.AddrPort{}
			for c := 1; c <= 3; c++ {
				home[c] = mustNext(t, lb, foo, client(c), false)
			}
			lb.SetEndpoints(foo, []netip.AddrPort{ep(1, 40), ep(2, 40)})
			for c := 1; c <= 3; c++ {
				got := mustNext(t, lb, foo, client(c), false)
				if home[c] != ep(3, 40) && got != home[c] {
					t.Errorf("client %d on a surviving endpoint moved from %v to %v", c, home[c], got)
				}
				if got == ep(3, 40) {
					t.Errorf("client %d still sent to removed endpoint %v", c, got)
				}
			}
			lb.SetEndpoints(foo, append(slices.Clone(three), ep(4, 40)))
			for c := 1; c <= 2; c++ {
				if got := mustNext(t, lb, foo, client(c), false); got != home[c] {
					t.Errorf("adding an endpoint moved client %d from %v to %v", c, home[c], got)
				}
			}
		}},
		{"full_replacement_drops_affinity", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetAffinity(foo, clientIP)
			lb.SetEndpoints(foo, three)
			mustNext(t, lb, foo, client(1), false)
			lb.SetEndpoints(foo, []netip.AddrPort{ep(4, 40), ep(5, 40)})
			if n := len(lb.Lookup(foo).AffinityEntries()); n != 0 {
				t.Errorf("affinity entries after full replacement = %d, want 0", n)
			}
			assertSticky(t, lb, foo, 2)
		}},
		{"service_removal_keeps_other_affinity", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetAffinity(foo, clientIP)
			lb.SetAffinity(bar, clientIP)
			lb.SetEndpoints(foo, three)
			lb.SetEndpoints(bar, three)
			mustNext(t, lb, bar, client(1), false)
			barHome := mustNext(t, lb, bar, client(2), false)
			lb.DeleteService(foo)
			if got := mustNext(t, lb, bar, client(2), false); got != barHome {
				t.Errorf("bar client moved from %v to %v after foo was removed", barHome, got)
			}
		}},
		{"reset_skips_sticky_and_rewrites", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetAffinity(foo, clientIP)
			lb.SetEndpoints(foo, three)
			home := mustNext(t, lb, foo, client(1), false)
			// Another client takes the next slot so round robin would land on home again.
			mustNext(t, lb, foo, client(2), false)
			mustNext(t, lb, foo, client(3), false)
			moved := mustNext(t, lb, foo, client(1), true)
			if moved == home {
				t.Fatalf("reset returned the failed sticky endpoint %v", home)
			}
			if got := mustNext(t, lb, foo, client(1), false); got != moved {
				t.Errorf("after reset client stuck to %v, want the new endpoint %v", got, moved)
			}
		}},
		{"expires_after_ttl", func(t *testing.T, lb *LoadBalancer, clk *clocktesting.FakeClock) {
			lb.SetAffinity(foo, service.Affinity{ClientIP: true, Timeout: 10 * time.Second})
			lb.SetEndpoints(foo, three)
			home := mustNext(t, lb, foo, client(1), false)
			clk.Step(9 * time.Second)
			if got := mustNext(t, lb, foo, client(1), false); got != home {
				t.Fatalf("within TTL client moved from %v to %v", home, got)
			}
			clk.Step(9 * time.Second) // the TTL slid with the last use
			if got := mustNext(t, lb, foo, client(1), false); got != home {
				t.Fatalf("sliding TTL: client moved from %v to %v", home, got)
			}
			clk.Step(10 * time.Second)
			if got := mustNext(t, lb, foo, client(1), false); got == home {
				t.Errorf("after TTL client still on %v", home)
			}
		}},
		{"custom_ttl_when_endpoints_arrive_first", func(t *testing.T, lb *LoadBalancer, clk *clocktesting.FakeClock) {
			// kubernetes#107398: the legacy balancer kept 10800s when endpoints came first.
			lb.SetEndpoints(foo, three)
			lb.SetAffinity(foo, service.Affinity{ClientIP: true, Timeout: 5 * time.Second})
			home := mustNext(t, lb, foo, client(1), false)
			clk.Step(6 * time.Second)
			if got := mustNext(t, lb, foo, client(1), false); got == home {
				t.Errorf("custom 5s timeout ignored: client still on %v after 6s", home)
			}
		}},
		{"only_timeout_change_applies", func(t *testing.T, lb *LoadBalancer, clk *clocktesting.FakeClock) {
			lb.SetAffinity(foo, service.Affinity{ClientIP: true, Timeout: time.Hour})
			lb.SetEndpoints(foo, three)
			home := mustNext(t, lb, foo, client(1), false)
			lb.SetAffinity(foo, service.Affinity{ClientIP: true, Timeout: 2 * time.Second})
			clk.Step(3 * time.Second)
			if got := mustNext(t, lb, foo, client(1), false); got == home {
				t.Errorf("new 2s timeout ignored: client still on %v", home)
			}
		}},
		{"default_ttl_is_10800s", func(t *testing.T, lb *LoadBalancer, clk *clocktesting.FakeClock) {
			lb.SetAffinity(foo, clientIP)
			lb.SetEndpoints(foo, three)
			home := mustNext(t, lb, foo, client(1), false)
			clk.Step(10799 * time.Second)
			if got := mustNext(t, lb, foo, client(1), false); got != home {
				t.Fatalf("client moved before the default TTL")
			}
			clk.Step(10800 * time.Second)
			if got := mustNext(t, lb, foo, client(1), false); got == home {
				t.Errorf("client still on %v after the default TTL", home)
			}
		}},
		{"cleanup_removes_only_expired", func(t *testing.T, lb *LoadBalancer, clk *clocktesting.FakeClock) {
			lb.SetAffinity(foo, service.Affinity{ClientIP: true, Timeout: 10 * time.Second})
			lb.SetEndpoints(foo, three)
			mustNext(t, lb, foo, client(1), false)
			clk.Step(6 * time.Second)
			mustNext(t, lb, foo, client(2), false)
			clk.Step(5 * time.Second)
			if n := lb.CleanupStaleAffinity(); n != 1 {
				t.Errorf("cleanup removed %d entries, want 1", n)
			}
			entries := lb.Lookup(foo).AffinityEntries()
			if len(entries) != 1 || entries[0].Client != client(2) {
				t.Errorf("entries after cleanup = %+v, want only client 2", entries)
			}
		}},
		{"turning_affinity_off_forgets_clients", func(t *testing.T, lb *LoadBalancer, _ *clocktesting.FakeClock) {
			lb.SetAffinity(foo, clientIP)
			lb.SetEndpoints(foo, three)
			mustNext(t, lb, foo, client(1), false)
			lb.SetAffinity(foo, service.Affinity{})
			if n := len(lb.Lookup(foo).AffinityEntries()); n != 0 {
				t.Errorf("entries after affinity off = %d, want 0", n)
			}
			got := picks(t, lb, foo, client(1), 3)
			if countOf(got, got[0]) != 1 {
				t.Errorf("without affinity one client should round robin, got %v", got)
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

// assertSticky checks that each of n clients gets one endpoint every time, and that together they
// used n different endpoints (round robin hands out fresh ones).
func assertSticky(t *testing.T, lb *LoadBalancer, name service.ServicePortName, n int) {
	t.Helper()
	home := map[int]netip.AddrPort{}
	used := map[netip.AddrPort]bool{}
	for round := 0; round < 3; round++ {
		for c := 1; c <= n; c++ {
			got := mustNext(t, lb, name, client(c), false)
			if round == 0 {
				home[c] = got
				used[got] = true
			} else if got != home[c] {
				t.Errorf("round %d: client %d moved from %v to %v", round, c, home[c], got)
			}
		}
	}
	if len(used) != n {
		t.Errorf("%d clients used endpoints %v, want %d different ones", n, used, n)
	}
}

func TestConcurrentPicksAndUpdates(t *testing.T) {
	lb, clk := newTestLB()
	lb.SetAffinity(foo, service.Affinity{ClientIP: true, Timeout: time.Minute})
	lb.SetEndpoints(foo, []netip.AddrPort{ep(1, 1), ep(2, 2)})
	lb.SetEndpoints(bar, []netip.AddrPort{ep(3, 3)})
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 4 {
		wg.Go(func() {
			for i := range 2000 {
				name := foo
				if i%3 == 0 {
					name = bar
				}
				got, err := lb.NextEndpoint(name, client(w*50+i%50), i%17 == 0)
				if err != nil {
					errs <- err
					return
				}
				if name == bar && got != ep(3, 3) {
					errs <- fmt.Errorf("bar picked %v", got)
					return
				}
			}
		})
	}
	wg.Go(func() {
		for i := range 300 {
			lb.SetEndpoints(foo, []netip.AddrPort{ep(1, 1), ep(2, 2), ep(10+i%3, 3)})
			lb.SetAffinity(foo, service.Affinity{ClientIP: i%2 == 0, Timeout: time.Minute})
			clk.Step(time.Second)
			lb.CleanupStaleAffinity()
		}
	})
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func BenchmarkNextEndpoint(b *testing.B) {
	for _, nEps := range []int{1, 100} {
		eps := make([]netip.AddrPort, nEps)
		for i := range eps {
			eps[i] = netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, byte(i / 250), byte(i%250 + 1)}), 8080)
		}
		clients := make([]netip.Addr, 10000)
		for i := range clients {
			clients[i] = netip.AddrFrom4([4]byte{172, 16, byte(i / 250), byte(i%250 + 1)})
		}
		for _, affinity := range []bool{false, true} {
			setup := func() *Service {
				lb := New(clock.RealClock{}) // the fake clock's mutex would dominate a parallel run
				lb.SetAffinity(foo, service.Affinity{ClientIP: affinity})
				lb.SetEndpoints(foo, eps)
				s := lb.Lookup(foo)
				for _, c := range clients { // warm the affinity table: steady state has every client
					_, _ = s.Next(c, false)
				}
				return s
			}
			name := fmt.Sprintf("eps=%d/affinity=%v", nEps, affinity)
			b.Run(name, func(b *testing.B) {
				s := setup()
				b.ReportAllocs()
				i := 0
				for b.Loop() {
					if _, err := s.Next(clients[i%len(clients)], false); err != nil {
						b.Fatal(err)
					}
					i++
				}
			})
			b.Run(name+"/parallel", func(b *testing.B) {
				s := setup()
				b.ReportAllocs()
				b.RunParallel(func(pb *testing.PB) {
					i := 0
					for pb.Next() {
						if _, err := s.Next(clients[i%len(clients)], false); err != nil {
							b.Error(err)
							return
						}
						i += 7
					}
				})
			})
		}
	}
}

// A set keeps each address with its own entry in both of its forms: small (searched) and large
// (indexed), shuffled or not, and an endpoint that stays keeps its entry (its flow count) across
// a replacement.
func TestEndpointSetEntries(t *testing.T) {
	reverse := func(l []netip.AddrPort) { slices.Reverse(l) }
	for _, n := range []int{1, 5, smallSet, smallSet + 1, 40} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			var eps []netip.AddrPort
			for i := range n {
				eps = append(eps, ep(i+1, 80))
			}
			eps = append(eps, ep(1, 80), netip.AddrPort{}) // a duplicate and an invalid one are left out
			first := newEndpointSet(eps, nil, reverse)
			if len(first.list) != n || len(first.eps) != n {
				t.Fatalf("set of %d: %d addresses, %d entries", n, len(first.list), len(first.eps))
			}
			if first.list[0] != ep(n, 80) {
				t.Errorf("first after the shuffle = %v, want %v", first.list[0], ep(n, 80))
			}
			for i, a := range first.list {
				if first.eps[i].addr != a || first.get(a) != first.eps[i] {
					t.Fatalf("entry %d: address %v, entry of %v", i, a, first.eps[i].addr)
				}
			}
			if first.get(ep(200, 80)) != nil {
				t.Error("an address not in the set has an entry")
			}
			next := newEndpointSet(append(eps[1:n:n], ep(200, 80)), first, reverse)
			if next.get(ep(2, 80)) != first.get(ep(2, 80)) {
				t.Error("an endpoint that stayed has a new entry")
			}
			if next.get(ep(1, 80)) != nil || next.get(ep(200, 80)) == nil || next.get(ep(200, 80)) == first.get(ep(200, 80)) && first.get(ep(200, 80)) != nil {
				t.Error("the replacement's members are wrong")
			}
			if !first.sameMembers(newEndpointSet(eps, nil, nil)) || first.sameMembers(next) {
				t.Error("sameMembers is wrong")
			}
		})
	}
}

// TestConcurrentRetriesAlwaysPick: a retry (reset) skips the client's sticky endpoint; while
// other pickers advance the shared round-robin counter at the same time, the n counter values one
// pick draws need not cover n different endpoints, and a pick that drew only the skipped one
// returned no endpoint (a nil dereference: TestConcurrentPicksAndUpdates panicked so in one of a
// few make test runs). Every pick of a service with endpoints must return one.
func TestConcurrentRetriesAlwaysPick(t *testing.T) {
	lb, _ := newTestLB()
	lb.SetAffinity(foo, service.Affinity{ClientIP: true, Timeout: time.Minute})
	lb.SetEndpoints(foo, []netip.AddrPort{ep(1, 1), ep(2, 2)})
	var wg sync.WaitGroup
	var nopick atomic.Int64
	var first atomic.Value
	for w := range 8 {
		wg.Go(func() {
			defer func() {
				if r := recover(); r != nil {
					nopick.Add(1)
					first.CompareAndSwap(nil, fmt.Sprint(r))
				}
			}()
			for i := range 20000 {
				if _, err := lb.NextEndpoint(foo, client(w*20+i%20), true); err != nil {
					nopick.Add(1)
					first.CompareAndSwap(nil, err.Error())
					return
				}
			}
		})
	}
	wg.Wait()
	if n := nopick.Load(); n != 0 {
		t.Fatalf("%d pickers got no endpoint from a service with two; the first: %v", n, first.Load())
	}
}
