package loadbalancer

// Address plan: roundrobin_test.go's (endpoints 10.0.0.<n>:<port>, clients 192.168.0.<n>).

import (
	"net/netip"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// TestImportAffinity: a hand-over successor keeps its predecessor's sticky clients on their
// endpoints, but only what is still valid here.
func TestImportAffinity(t *testing.T) {
	sticky := service.Affinity{ClientIP: true, Timeout: 10 * time.Second}
	for _, tc := range []struct {
		name     string
		affinity service.Affinity
		entry    func(now time.Time) AffinityEntry
		own      bool // the client picked in this process before the import
		took     int
		want     int // the endpoint (10.0.0.<want>:80) the client's next pick gets
	}{
		{"a client keeps its endpoint", sticky,
			func(now time.Time) AffinityEntry { return AffinityEntry{client(1), ep(3, 80), now.Add(-time.Second)} }, false, 1, 3},
		{"an endpoint no longer in use is dropped", sticky,
			func(now time.Time) AffinityEntry { return AffinityEntry{client(1), ep(9, 80), now} }, false, 0, 1},
		{"an entry past the timeout is dropped", sticky,
			func(now time.Time) AffinityEntry {
				return AffinityEntry{client(1), ep(3, 80), now.Add(-10 * time.Second)}
			}, false, 0, 1},
		{"a port without ClientIP affinity takes none", service.Affinity{},
			func(now time.Time) AffinityEntry { return AffinityEntry{client(1), ep(3, 80), now} }, false, 0, 1},
		{"this process's own pick wins", sticky,
			func(now time.Time) AffinityEntry { return AffinityEntry{client(1), ep(3, 80), now} }, true, 0, 1},
		{"a last use in the future counts as now", sticky,
			func(now time.Time) AffinityEntry { return AffinityEntry{client(1), ep(2, 80), now.Add(time.Hour)} }, false, 1, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lb, clk := newTestLB()
			lb.SetAffinity(foo, tc.affinity)
			lb.SetEndpoints(foo, []netip.AddrPort{ep(1, 80), ep(2, 80), ep(3, 80)})
			if tc.own {
				if got, _ := lb.NextEndpoint(foo, client(1), false); got != ep(1, 80) {
					t.Fatalf("own pick %v, want %v", got, ep(1, 80))
				}
			}
			if took := lb.ImportAffinity(foo, []AffinityEntry{tc.entry(clk.Now())}); took != tc.took {
				t.Errorf("ImportAffinity took %d, want %d", took, tc.took)
			}
			if got, _ := lb.NextEndpoint(foo, client(1), false); got != ep(tc.want, 80) {
				t.Errorf("next pick of the client %v, want %v", got, ep(tc.want, 80))
			}
			if tc.took == 1 {
				// The imported entry slides on like any other: 9 s later it still holds.
				clk.Step(9 * time.Second)
				if got, _ := lb.NextEndpoint(foo, client(1), false); got != ep(tc.want, 80) {
					t.Errorf("pick 9s later %v, want %v", got, ep(tc.want, 80))
				}
			}
		})
	}
	t.Run("an unknown port takes none", func(t *testing.T) {
		lb, clk := newTestLB()
		if took := lb.ImportAffinity(bar, []AffinityEntry{{client(1), ep(1, 80), clk.Now()}}); took != 0 {
			t.Errorf("took %d, want 0", took)
		}
	})
}
