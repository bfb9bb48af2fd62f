package proxier

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan: as sync_test.go; node address 192.0.2.1 (node port), load-balancer IP
// 198.51.100.20; endpoint 10.244.1.1 on this node (node-a), 10.244.2.1 on node-b.

// bindPlanForTest is daemon's bind plan in small: every portal IP at the service port, the node
// port on the node address.
func bindPlanForTest(p *service.Port) []netip.AddrPort {
	var out []netip.AddrPort
	for _, group := range [][]netip.Addr{p.ClusterIPs, p.ExternalIPs, p.LoadBalancerIPs} {
		for _, ip := range group {
			out = append(out, netip.AddrPortFrom(ip, p.Port))
		}
	}
	if p.NodePort != 0 {
		out = append(out, netip.AddrPortFrom(netip.MustParseAddr("192.0.2.1"), p.NodePort))
	}
	return out
}

// refusing renders which built, still open sockets refuse: "addr=true|false", sorted.
func (e *fakeEnv) refusing() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []string
	for _, s := range e.built {
		select {
		case <-s.closed:
			continue
		default:
		}
		out = append(out, fmt.Sprintf("%s=%t", s.addr, s.refusing))
	}
	slices.Sort(out)
	return strings.Join(out, " ")
}

func lbWeb(ranges ...string) func(*v1.Service) {
	return func(s *v1.Service) {
		s.Spec.Type = v1.ServiceTypeLoadBalancer
		s.Spec.Ports[0].NodePort = 30080
		s.Spec.LoadBalancerSourceRanges = ranges
		s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "198.51.100.20"}}
	}
}

// TestBindModeRefusesWithoutEndpoints: in bind mode a service port without endpoints keeps its
// portal spec (its addresses stay on the interface) but its sockets stop listening, so the kernel
// refuses; they listen again once an endpoint appears. A split port refuses only the class
// without endpoints. The refused gauge counts ports per class, in both modes.
func TestBindModeRefusesWithoutEndpoints(t *testing.T) {
	e := newFakeEnv(t, func(c *Config) {
		c.ListenPlan = bindPlanForTest
		c.Node = NodeTopology{Name: "node-a"}
	})
	e.p.OnServiceAdd(webService(lbWeb()))
	e.synced()
	e.sync()
	gauge := func(class string) float64 {
		return testutil.ToFloat64(e.p.deps.Metrics.RefusedPorts.WithLabelValues(class))
	}
	steps := []struct {
		name          string
		apply         func()
		want          string
		cluster, ext  float64
		specsRefusing [2]bool // RejectInternal, RejectExternal
	}{
		{
			name:  "no_endpoints_every_socket_refuses",
			apply: func() {},
			want:  "10.96.0.10:80=true 192.0.2.1:30080=true 198.51.100.20:80=true", cluster: 1, ext: 1,
			specsRefusing: [2]bool{true, true},
		},
		{
			name:  "an_endpoint_appears_every_socket_listens",
			apply: func() { e.p.OnEndpointSliceAdd(onNodes("10.244.2.1@node-b")) },
			want:  "10.96.0.10:80=false 192.0.2.1:30080=false 198.51.100.20:80=false",
		},
		{
			name: "external_policy_Local_without_a_local_endpoint_refuses_external_only",
			apply: func() {
				e.p.OnServiceUpdate(nil, webService(func(s *v1.Service) {
					lbWeb()(s)
					s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
				}))
			},
			want: "10.96.0.10:80=false 192.0.2.1:30080=true 198.51.100.20:80=true", ext: 1,
			specsRefusing: [2]bool{false, true},
		},
		{
			name:  "a_local_endpoint_appears_external_listens_again",
			apply: func() { e.p.OnEndpointSliceUpdate(nil, onNodes("10.244.1.1@node-a", "10.244.2.1@node-b")) },
			want:  "10.96.0.10:80=false 192.0.2.1:30080=false 198.51.100.20:80=false",
		},
	}
	for _, s := range steps {
		t.Run(s.name, func(t *testing.T) {
			s.apply()
			e.sync()
			if got := e.refusing(); got != s.want {
				t.Errorf("sockets refusing (-want +got):\n- %s\n+ %s", s.want, got)
			}
			if spec := e.spec(t); spec.RejectInternal != s.specsRefusing[0] || spec.RejectExternal != s.specsRefusing[1] {
				t.Errorf("spec refusals internal=%t external=%t, want %v", spec.RejectInternal, spec.RejectExternal, s.specsRefusing)
			}
			if c, x := gauge("cluster"), gauge("external"); c != s.cluster || x != s.ext {
				t.Errorf("refused gauge cluster=%v external=%v, want %v and %v", c, x, s.cluster, s.ext)
			}
		})
	}
}

// TestBindModeChecksSourceRangesOnLoadBalancerIPs: only the sockets on load-balancer IPs get the
// allow-check; it follows the Service's ranges as they change under the live socket; iptables mode
// builds no check (its rules filter).
func TestBindModeChecksSourceRangesOnLoadBalancerIPs(t *testing.T) {
	allowed, other := netip.MustParseAddr("192.0.2.7"), netip.MustParseAddr("203.0.113.9")
	e := newFakeEnv(t, func(c *Config) { c.ListenPlan = bindPlanForTest })
	e.p.OnServiceAdd(webService(lbWeb("192.0.2.0/24")))
	e.p.OnEndpointSliceAdd(webSlice("web-1", 8080, "10.244.1.1"))
	e.synced()
	e.sync()
	checks := func() map[netip.AddrPort]func(netip.Addr) bool {
		e.mu.Lock()
		defer e.mu.Unlock()
		out := map[netip.AddrPort]func(netip.Addr) bool{}
		for _, s := range e.built {
			out[s.addr] = s.allow
		}
		return out
	}
	lb := netip.MustParseAddrPort("198.51.100.20:80")
	for addr, allow := range checks() {
		if (allow != nil) != (addr == lb) {
			t.Errorf("socket %s has a source check: %t, want one only on the load-balancer IP", addr, allow != nil)
		}
	}
	allow := checks()[lb]
	if allow == nil {
		t.Fatal("no source check on the load-balancer IP")
	}
	if !allow(allowed) || allow(other) {
		t.Errorf("ranges 192.0.2.0/24: allow(%s)=%t allow(%s)=%t, want true, false", allowed, allow(allowed), other, allow(other))
	}
	if !allow(netip.AddrFrom16(allowed.As16())) {
		t.Errorf("a v4-mapped client in the range is denied")
	}
	e.p.OnServiceUpdate(nil, webService(lbWeb("203.0.113.0/24")))
	e.sync()
	if got := checks()[lb]; got == nil || allow(allowed) || !allow(other) {
		t.Errorf("after the ranges changed to 203.0.113.0/24: allow(%s)=%t allow(%s)=%t, want false, true (same socket)",
			allowed, allow(allowed), other, allow(other))
	}
	e.p.OnServiceUpdate(nil, webService(lbWeb()))
	e.sync()
	if !allow(allowed) || !allow(other) {
		t.Errorf("without ranges every client must be allowed")
	}

	ipt := newFakeEnv(t, nil)
	ipt.p.OnServiceAdd(webService(lbWeb("192.0.2.0/24")))
	ipt.synced()
	ipt.sync()
	for addr, allow := range func() map[netip.AddrPort]func(netip.Addr) bool {
		ipt.mu.Lock()
		defer ipt.mu.Unlock()
		out := map[netip.AddrPort]func(netip.Addr) bool{}
		for _, s := range ipt.built {
			out[s.addr] = s.allow
		}
		return out
	}() {
		if allow != nil {
			t.Errorf("iptables mode socket %s has a source check; the portal rules filter there", addr)
		}
	}
}
