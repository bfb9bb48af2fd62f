package proxier

// Address plan: Service ns/web at 10.96.0.10:80 (TCP "http", or UDP "dns"), endpoints
// 10.0.0.1-2:8080; fake sockets, nothing is dialled.

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/debugview"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

func (s *fakeSocket) DrainEndpoint(ep netip.AddrPort, grace time.Duration) int {
	s.env.mu.Lock()
	defer s.env.mu.Unlock()
	s.drained = append(s.drained, ep)
	return 1
}

// calls reports what the open socket of name was asked: "drop <ep>" and "drain <ep>", in order
// of kind (drops first).
func (e *fakeEnv) calls(name service.ServicePortName) []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	s := e.open[name]
	if s == nil {
		return nil
	}
	var out []string
	for _, ep := range s.dropped {
		out = append(out, "drop "+ep.String())
	}
	for _, ep := range s.drained {
		out = append(out, "drain "+ep.String())
	}
	return out
}

// Endpoint states of the scenarios.
var (
	epReady       = sliceEP{}
	epTerminating = sliceEP{ready: ptr(false), serving: ptr(true), terminating: ptr(true)}
	epStopped     = sliceEP{ready: ptr(false), serving: ptr(false), terminating: ptr(true)}
	epGone        = sliceEP{addr: "-"}
)

// TestDrainPolicy: what happens to the flows of an endpoint (10.0.0.2) that leaves the rotation,
// step by step, for each combination of the drain-timeout annotation, --drain-removed-endpoints
// and protocol. 10.0.0.1 stays ready throughout, so 10.0.0.2 is never used as a fallback.
func TestDrainPolicy(t *testing.T) {
	type step struct {
		state   sliceEP       // 10.0.0.2's state after the step
		advance time.Duration // clock step after the state change
		want    []string      // the socket's calls so far
	}
	const ep2 = "10.0.0.2:8080"
	tests := []struct {
		name     string
		flag     bool
		drain    string // annotation value, "" for none
		protocol v1.Protocol
		steps    []step
	}{
		{name: "annotation_terminating_serving_kept_until_the_deadline", drain: "60s", protocol: v1.ProtocolTCP, steps: []step{
			{state: epTerminating, advance: 59 * time.Second, want: nil},
			{state: epTerminating, advance: time.Second, want: []string{"drain " + ep2}},
		}},
		{name: "annotation_wins_over_the_flag_for_a_removed_endpoint", flag: true, drain: "60s", protocol: v1.ProtocolTCP, steps: []step{
			{state: epGone, advance: 30 * time.Second, want: nil},
			{state: epGone, advance: 30 * time.Second, want: []string{"drain " + ep2}},
		}},
		{name: "annotation_deadline_counts_from_leaving_the_rotation", drain: "60s", protocol: v1.ProtocolTCP, steps: []step{
			{state: epTerminating, advance: 40 * time.Second, want: nil},
			{state: epStopped, advance: 10 * time.Second, want: nil},
			{state: epGone, advance: 10 * time.Second, want: []string{"drain " + ep2}},
		}},
		{name: "annotation_endpoint_back_before_the_deadline_is_not_closed", drain: "60s", protocol: v1.ProtocolTCP, steps: []step{
			{state: epTerminating, advance: 30 * time.Second, want: nil},
			{state: epReady, advance: 60 * time.Second, want: nil},
		}},
		{name: "annotation_udp_sessions_kept_until_the_deadline", drain: "10s", protocol: v1.ProtocolUDP, steps: []step{
			{state: epGone, advance: 9 * time.Second, want: nil},
			{state: epGone, advance: time.Second, want: []string{"drain " + ep2}},
		}},
		{name: "flag_never_resets_a_serving_endpoint", flag: true, protocol: v1.ProtocolTCP, steps: []step{
			{state: epTerminating, advance: time.Hour, want: nil},
			{state: epStopped, want: []string{"drop " + ep2}},
			{state: epGone, want: []string{"drop " + ep2}},
		}},
		{name: "flag_resets_a_removed_endpoint_at_once", flag: true, protocol: v1.ProtocolTCP, steps: []step{
			{state: epGone, want: []string{"drop " + ep2}},
		}},
		{name: "flag_kept_serving_endpoint_reset_when_removed", flag: true, protocol: v1.ProtocolTCP, steps: []step{
			{state: epTerminating, want: nil},
			{state: epGone, want: []string{"drop " + ep2}},
		}},
		{name: "neither_keeps_tcp_forever", protocol: v1.ProtocolTCP, steps: []step{
			{state: epTerminating, advance: time.Hour, want: nil},
			{state: epGone, advance: time.Hour, want: nil},
		}},
		{name: "neither_moves_udp_at_once", protocol: v1.ProtocolUDP, steps: []step{
			{state: epGone, want: []string{"drop " + ep2}},
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newFakeEnv(t, func(c *Config) { c.DrainTCP = tc.flag })
			e.synced()
			portName := "http"
			if tc.protocol == v1.ProtocolUDP {
				portName = "dns"
			}
			svcPort := v1.ServicePort{Name: portName, Port: 80, Protocol: tc.protocol}
			e.p.OnServiceAdd(makeService("ns", "web", "10.96.0.10", func(s *v1.Service) {
				if tc.drain != "" {
					s.Annotations = map[string]string{AnnotationDrainTimeout: tc.drain}
				}
			}, svcPort))
			slice := func(second sliceEP) *discovery.EndpointSlice {
				eps := []sliceEP{{addr: "10.0.0.1"}}
				if second.addr != "-" {
					second.addr = "10.0.0.2"
					eps = append(eps, second)
				}
				return makeSlice("ns", "web", "web-1", discovery.AddressTypeIPv4,
					[]discovery.EndpointPort{slicePortOf(portName, tc.protocol, 8080)}, eps...)
			}
			e.p.OnEndpointSliceAdd(slice(epReady))
			e.sync()
			name := service.ServicePortName{Namespace: "ns", Name: "web", Port: portName}
			for i, s := range tc.steps {
				e.p.OnEndpointSliceUpdate(nil, slice(s.state))
				if s.advance > 0 {
					e.clk.Step(s.advance)
				}
				// A fired deadline drains on its own goroutine; one that has not fired is still a
				// waiter of the fake clock, so a call that is not wanted cannot come later.
				testenv.WaitFor(t, fmt.Sprintf("step %d: socket calls %q", i+1, s.want), func() bool {
					return slices.Equal(e.calls(name), s.want)
				})
				if got := e.calls(name); !slices.Equal(got, s.want) {
					t.Fatalf("step %d: socket calls = %q, want %q", i+1, got, s.want)
				}
			}
		})
	}
}

// TestDrainShown: the debug view shows the drain-timeout and the endpoints waiting for their
// deadline.
func TestDrainShown(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.synced()
	e.p.OnServiceAdd(webService(annotated(AnnotationDrainTimeout, "1m")))
	e.p.OnEndpointSliceAdd(webSlice("web-1", 8080, "10.0.0.1", "10.0.0.2"))
	e.sync()
	e.p.OnEndpointSliceUpdate(nil, webSlice("web-1", 8080, "10.0.0.1"))
	e.clk.Step(15 * time.Second)
	v := e.p.Services()[0]
	if v.DrainTimeout != "1m0s" || len(v.Draining) != 1 || v.Draining[0] != (debugview.DrainView{Endpoint: "10.0.0.2:8080", ClosesIn: "45s"}) {
		t.Errorf("view: drainTimeout %q draining %+v, want 1m0s and 10.0.0.2:8080 closing in 45s", v.DrainTimeout, v.Draining)
	}
}

func TestConvertDrainTimeoutAnnotation(t *testing.T) {
	tests := []struct {
		name, value string // value "" leaves the annotation out
		want        time.Duration
		wantErr     bool
	}{
		{name: "unset_is_the_node_default"},
		{name: "seconds", value: "60s", want: time.Minute},
		{name: "spaces_trimmed", value: " 2m ", want: 2 * time.Minute},
		{name: "no_unit_falls_back", value: "60", wantErr: true},
		{name: "zero_falls_back", value: "0s", wantErr: true},
		{name: "longer_than_a_day_falls_back", value: "48h", wantErr: true},
		{name: "garbage_falls_back", value: "forever", wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var kv []string
			if tc.value != "" {
				kv = []string{AnnotationDrainTimeout, tc.value}
			}
			ports, errs := convertService(webService(annotated(kv...)))
			if len(ports) != 1 {
				t.Fatalf("ports = %v, want one: a bad annotation must not drop the port", ports)
			}
			if got := ports[0].DrainTimeout; got != tc.want {
				t.Errorf("DrainTimeout = %v, want %v", got, tc.want)
			}
			if tc.wantErr != (len(errs) == 1 && errors.Is(errs[0], ErrInvalidAnnotation)) || (!tc.wantErr && len(errs) != 0) {
				t.Errorf("errors = %v, want an ErrInvalidAnnotation: %v", errs, tc.wantErr)
			}
		})
	}
}
