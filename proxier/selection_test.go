package proxier

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// Address plan: as sync_test.go; endpoint 10.244.1.1 runs on this node (node-a), 10.244.2.1 on
// node-b.

// onNodes builds a slice of ready endpoints placed on nodes ("addr@node").
func onNodes(eps ...string) *discovery.EndpointSlice {
	s := webSlice("web-1", 8080)
	for _, e := range eps {
		var addr, node string
		fmt.Sscanf(e, "%s", &addr)
		for i := range e {
			if e[i] == '@' {
				addr, node = e[:i], e[i+1:]
			}
		}
		s.Endpoints = append(s.Endpoints, discovery.Endpoint{Addresses: []string{addr}, NodeName: ptr(node),
			Conditions: discovery.EndpointConditions{Ready: ptr(true)}})
	}
	return s
}

func (e *fakeEnv) spec(t *testing.T) portal.Spec {
	t.Helper()
	e.portals.mu.Lock()
	defer e.portals.mu.Unlock()
	if len(e.portals.specs) != 1 {
		t.Fatalf("portal specs: %+v, want one", e.portals.specs)
	}
	return e.portals.specs[0]
}

func (e *fakeEnv) balancer(key string) []string {
	var out []string
	for _, n := range e.lb.Names() {
		if n.String() == key {
			for _, ep := range e.lb.Service(n).Endpoints() {
				out = append(out, ep.String())
			}
		}
	}
	slices.Sort(out)
	return out
}

func TestSyncTrafficPolicies(t *testing.T) {
	local := func(s *v1.Service) {
		s.Spec.Type = v1.ServiceTypeNodePort
		s.Spec.Ports[0].NodePort = 30080
		s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
	}
	e := newFakeEnv(t, func(c *Config) { c.Node = NodeTopology{Name: "node-a"} })
	e.p.OnServiceAdd(webService(local))
	e.p.OnEndpointSliceAdd(onNodes("10.244.1.1@node-a", "10.244.2.1@node-b"))
	e.synced()
	e.sync()

	t.Run("external_traffic_gets_its_own_socket_and_local_endpoints", func(t *testing.T) {
		s := e.spec(t)
		if s.ExternalProxyPort == 0 || s.ExternalProxyPort == s.ProxyPort || s.RejectInternal || s.RejectExternal {
			t.Errorf("spec %+v: want a distinct external proxy port and nothing refused", s)
		}
		if got := e.balancer("ns/web:http"); !slices.Equal(got, []string{"10.244.1.1:8080", "10.244.2.1:8080"}) {
			t.Errorf("cluster traffic endpoints %v, want both", got)
		}
		if got := e.balancer("ns/web:http#external"); !slices.Equal(got, []string{"10.244.1.1:8080"}) {
			t.Errorf("external traffic endpoints %v, want only the one on node-a", got)
		}
	})

	t.Run("no_local_endpoint_refuses_external_traffic_only", func(t *testing.T) {
		e.p.OnEndpointSliceUpdate(nil, onNodes("10.244.2.1@node-b"))
		e.sync()
		s := e.spec(t)
		if s.RejectInternal || !s.RejectExternal {
			t.Errorf("spec %+v: want external traffic refused, cluster traffic served", s)
		}
		if got := e.balancer("ns/web:http#external"); len(got) != 0 {
			t.Errorf("external traffic endpoints %v, want none (never another node's)", got)
		}
	})

	t.Run("no_endpoint_at_all_refuses_everything_until_one_appears", func(t *testing.T) {
		e.p.OnEndpointSliceUpdate(nil, onNodes())
		e.sync()
		if s := e.spec(t); !s.RejectInternal || !s.RejectExternal {
			t.Errorf("spec %+v: want every portal refused", s)
		}
		e.p.OnEndpointSliceUpdate(nil, onNodes("10.244.1.1@node-a"))
		e.sync()
		if s := e.spec(t); s.RejectInternal || s.RejectExternal {
			t.Errorf("spec %+v after an endpoint appeared: want nothing refused", s)
		}
	})

	t.Run("policy_back_to_Cluster_closes_the_external_socket", func(t *testing.T) {
		e.p.OnServiceUpdate(nil, webService(func(s *v1.Service) {
			local(s)
			s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyCluster
		}))
		e.sync()
		if s := e.spec(t); s.ExternalProxyPort != 0 {
			t.Errorf("spec %+v: want no external proxy port under the Cluster policy", s)
		}
		if got := e.balancer("ns/web:http#external"); got != nil {
			t.Errorf("external balancer entry %v left behind", got)
		}
	})

	t.Run("source_ranges_reach_the_portals", func(t *testing.T) {
		e.p.OnServiceUpdate(nil, webService(func(s *v1.Service) {
			s.Spec.Type = v1.ServiceTypeLoadBalancer
			s.Spec.Ports[0].NodePort = 30080
			s.Spec.LoadBalancerSourceRanges = []string{"192.0.2.0/24"}
			s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "198.51.100.20"}}
		}))
		e.sync()
		if s := e.spec(t); !slices.Equal(s.SourceRanges, []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}) {
			t.Errorf("spec source ranges %v", s.SourceRanges)
		}
	})
}

func TestSyncTriggeredWhenRefusalChanges(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.p.OnServiceAdd(webService(nil))
	e.synced()
	e.sync()
	select { // drain the trigger left by the synced sources
	case <-e.p.runner.trigger:
	default:
	}
	e.p.OnEndpointSliceAdd(webSlice("web-1", 8080, "10.244.1.1"))
	select {
	case <-e.p.runner.trigger:
	default:
		t.Fatal("the first endpoint of a refused port did not ask for a sync")
	}
	e.p.OnEndpointSliceUpdate(nil, webSlice("web-1", 8080, "10.244.1.1", "10.244.1.2"))
	select {
	case <-e.p.runner.trigger:
		t.Fatal("a second endpoint asked for a sync; only refusal changes need one")
	default:
	}
}
