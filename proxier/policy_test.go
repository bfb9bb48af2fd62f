package proxier

// Address plan: Service ns/web at 10.96.0.10:80, endpoints 10.0.0.<n>:8080; nothing is dialled.

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

func annotated(kv ...string) func(*v1.Service) {
	return func(s *v1.Service) {
		s.Annotations = map[string]string{}
		for i := 0; i+1 < len(kv); i += 2 {
			s.Annotations[kv[i]] = kv[i+1]
		}
	}
}

func TestConvertBalancingAnnotations(t *testing.T) {
	tests := []struct {
		name    string
		kv      []string
		want    service.Balancing
		wantErr string // substring of the one error; "" for none
	}{
		{name: "unset_is_round_robin", want: service.Balancing{}},
		{name: "round_robin", kv: []string{AnnotationAlgorithm, "round-robin"}, want: service.Balancing{Algorithm: service.RoundRobin}},
		{name: "least_connections", kv: []string{AnnotationAlgorithm, "least-connections"}, want: service.Balancing{Algorithm: service.LeastConnections}},
		{name: "random_two_choices_with_spaces", kv: []string{AnnotationAlgorithm, " random-two-choices "}, want: service.Balancing{Algorithm: service.RandomTwoChoices}},
		{name: "unknown_algorithm_falls_back", kv: []string{AnnotationAlgorithm, "leastconn"},
			want: service.Balancing{}, wantErr: `portal-proxy.kubernetes.io/algorithm="leastconn"`},
		{name: "wrong_case_falls_back", kv: []string{AnnotationAlgorithm, "Round-Robin"},
			want: service.Balancing{}, wantErr: "want round-robin, least-connections or random-two-choices"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ports, errs := convertService(webService(annotated(tc.kv...)))
			if len(ports) != 1 {
				t.Fatalf("ports = %v, want one: a bad annotation must not drop the port", ports)
			}
			if got := ports[0].Balancing; got != tc.want {
				t.Errorf("Balancing = %+v, want %+v", got, tc.want)
			}
			switch {
			case tc.wantErr == "" && len(errs) != 0:
				t.Errorf("errors = %v, want none", errs)
			case tc.wantErr != "" && (len(errs) != 1 || !strings.Contains(errs[0].Error(), tc.wantErr) || !errors.Is(errs[0], ErrInvalidAnnotation)):
				t.Errorf("errors = %v, want one ErrInvalidAnnotation containing %q", errs, tc.wantErr)
			}
		})
	}
}

func TestInvalidAnnotationWarnsOncePerNewValue(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.synced()
	var events []string
	e.p.deps.Event = func(n service.ServicePortName, reason, msg string) {
		events = append(events, n.String()+" "+reason+" "+msg)
	}
	bad := webService(annotated(AnnotationAlgorithm, "fastest"))
	e.p.OnServiceAdd(bad)
	e.p.OnServiceUpdate(nil, bad) // a resync: same value, no second event
	e.p.OnServiceUpdate(nil, webService(annotated(AnnotationAlgorithm, "least-connections")))
	e.p.OnServiceUpdate(nil, webService(annotated(AnnotationAlgorithm, "slowest")))
	e.p.OnServiceUpdate(nil, webService(annotated(AnnotationAlgorithm, "slowest")))
	if len(events) != 2 || !strings.HasPrefix(events[0], "ns/web InvalidAnnotation ") ||
		!strings.Contains(events[0], `"fastest"`) || !strings.Contains(events[1], `"slowest"`) {
		t.Errorf("events = %q, want one InvalidAnnotation event on ns/web for each new bad value", events)
	}
}

func TestBalancingReachesBalancerAndDebugView(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.synced()
	e.p.OnServiceAdd(webService(annotated(AnnotationAlgorithm, "least-connections")))
	e.p.OnEndpointSliceAdd(webSlice("web-1", 8080, "10.0.0.1", "10.0.0.2"))
	e.sync()
	b := e.lb.Lookup(webHTTP)
	if b == nil || b.Balancing().Algorithm != service.LeastConnections {
		t.Fatalf("balancer of %s: %+v, want least-connections", webHTTP, b)
	}
	if _, err := b.Next(netip.MustParseAddr("192.168.0.1"), false); err != nil {
		t.Fatal(err)
	}
	views := e.p.Services()
	if len(views) != 1 || views[0].Balancing.Algorithm != "least-connections" {
		t.Fatalf("Services() = %+v, want one least-connections port", views)
	}
	var active []int64
	for _, ev := range views[0].Endpoints {
		active = append(active, ev.Active)
	}
	slices.Sort(active)
	if !slices.Equal(active, []int64{0, 1}) {
		t.Errorf("endpoint active counts = %v, want [0 1] after one pick", active)
	}
	// Back to the default when the annotation goes.
	e.p.OnServiceUpdate(nil, webService(nil))
	if got := e.lb.Lookup(webHTTP).Balancing().Algorithm; got != service.RoundRobin {
		t.Errorf("after the annotation was removed: %q, want round-robin", got)
	}
	if got := e.p.Services()[0].Balancing.Algorithm; got != "round-robin" {
		t.Errorf("debug view after removal: %q, want round-robin", got)
	}
}
