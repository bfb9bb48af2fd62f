package proxier

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/metrics"
)

// stamped is s with the EndpointSlice controller's trigger-time annotation at t.
func stamped(s *discovery.EndpointSlice, t time.Time) *discovery.EndpointSlice {
	s.Annotations = map[string]string{v1.EndpointsLastChangeTriggerTime: t.UTC().Format(time.RFC3339Nano)}
	return s
}

// TestNetworkProgrammingLatencyMeasuredAsKubeProxy checks which endpoint changes are observed in
// kubeproxy_network_programming_duration_seconds, and from when to when: as kube-proxy, only
// slices with a trigger time after the proxier started, never deletions; from the trigger time to
// the change in force (at once when only the balancer changes, after the sync when rules change).
func TestNetworkProgrammingLatencyMeasuredAsKubeProxy(t *testing.T) {
	tests := []struct {
		name string
		// event delivers one slice change to a proxier serving web with one endpoint, 3 s after
		// it started, and returns whether a sync follows before the metric is read.
		event     func(e *fakeEnv, started time.Time) (sync bool)
		wantCount int
		wantSum   float64
	}{
		{"stamped update, in force at once: trigger to now", func(e *fakeEnv, started time.Time) bool {
			e.p.OnEndpointSliceUpdate(nil, stamped(webSlice("a", 8080, "10.244.1.2"), started.Add(1500*time.Millisecond)))
			return false
		}, 1, 1.5},
		{"no annotation: not observed", func(e *fakeEnv, _ time.Time) bool {
			e.p.OnEndpointSliceUpdate(nil, webSlice("a", 8080, "10.244.1.2"))
			return false
		}, 0, 0},
		{"trigger before the proxier started (an initial list's): not observed", func(e *fakeEnv, started time.Time) bool {
			e.p.OnEndpointSliceUpdate(nil, stamped(webSlice("a", 8080, "10.244.1.2"), started.Add(-time.Minute)))
			return false
		}, 0, 0},
		{"deletion: not observed", func(e *fakeEnv, started time.Time) bool {
			e.p.OnEndpointSliceDelete(stamped(webSlice("a", 8080, "10.244.1.1"), started.Add(time.Second)))
			return true
		}, 0, 0},
		{"unparsable annotation: not observed", func(e *fakeEnv, _ time.Time) bool {
			s := webSlice("a", 8080, "10.244.1.2")
			s.Annotations = map[string]string{v1.EndpointsLastChangeTriggerTime: "yesterday"}
			e.p.OnEndpointSliceUpdate(nil, s)
			return false
		}, 0, 0},
		{"change that changes rules (last endpoint gone): observed after the sync", func(e *fakeEnv, started time.Time) bool {
			e.p.OnEndpointSliceUpdate(nil, stamped(webSlice("a", 8080), started.Add(time.Second)))
			if n := testutil.CollectAndCount(e.p.deps.Metrics.Programming); n != 0 {
				e.t.Errorf("observed before the sync put the refusal in force (%d series)", n)
			}
			e.clk.Step(time.Second) // the sync ends 3 s after the trigger
			return true
		}, 1, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newFakeEnv(t, nil)
			started := e.clk.Now()
			e.synced()
			e.p.OnServiceAdd(webService(nil))
			e.p.OnEndpointSliceAdd(webSlice("a", 8080, "10.244.1.1"))
			e.sync()
			e.clk.Step(3 * time.Second)
			if tt.event(e, started) {
				e.sync()
			}
			got := testutil.CollectAndCount(e.p.deps.Metrics.Programming)
			if tt.wantCount == 0 {
				if got != 0 {
					t.Fatalf("observed %d series, want none", got)
				}
				return
			}
			count, sum, family := programmingSeries(t, e.p.deps.Metrics)
			if count != uint64(tt.wantCount) || sum != tt.wantSum || family != "IPv4" {
				t.Fatalf("observed %d samples summing to %vs, ip_family %q; want %d summing to %vs, IPv4", count, sum, family, tt.wantCount, tt.wantSum)
			}
		})
	}
}

// programmingSeries reads the one series of the histogram: its count, sum and ip_family label.
func programmingSeries(t *testing.T, m *metrics.Metrics) (uint64, float64, string) {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(m.Programming); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if len(mfs) != 1 || len(mfs[0].GetMetric()) != 1 {
		t.Fatalf("gathered %v, want one series", mfs)
	}
	mf := mfs[0]
	if mf.GetName() != "kubeproxy_network_programming_duration_seconds" {
		t.Fatalf("name %q", mf.GetName())
	}
	s := mf.GetMetric()[0]
	family := ""
	for _, l := range s.GetLabel() {
		if l.GetName() == "ip_family" {
			family = l.GetValue()
		}
	}
	return s.GetHistogram().GetSampleCount(), s.GetHistogram().GetSampleSum(), family
}
