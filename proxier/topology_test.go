package proxier

// Address plan: endpoints 10.0.0.x:80 and 10.1.2.x:80 (the numbering of kube-proxy's
// TestCategorizeEndpoints, whose cases these follow), fd00:244::x for IPv6; this node is "node-a"
// in zone "zone-a", other endpoints run on "node-b". Pure selection; no traffic.

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// ep builds an endpoint from a compact description: "10.0.0.1:80 ready local zones=a,b nodes=n",
// with the flags ready, serving, terminating (serving-terminating: "terminating" alone implies
// serving unless "notserving" is given), local (on node-a; else on node-b) and nonode.
func ep(desc string) service.Endpoint {
	f := strings.Fields(desc)
	e := service.Endpoint{Addr: netip.MustParseAddrPort(f[0]), NodeName: "node-b"}
	for _, w := range f[1:] {
		switch {
		case w == "ready":
			e.Ready, e.Serving = true, true
		case w == "terminating":
			e.Terminating, e.Serving = true, true
		case w == "notserving":
			e.Serving = false
		case w == "local":
			e.NodeName = "node-a"
		case w == "nonode":
			e.NodeName = ""
		case strings.HasPrefix(w, "zones="):
			e.ZoneHints = sortedSet(strings.Split(strings.TrimPrefix(w, "zones="), ","))
		case strings.HasPrefix(w, "nodes="):
			e.NodeHints = sortedSet(strings.Split(strings.TrimPrefix(w, "nodes="), ","))
		default:
			panic("unknown endpoint flag " + w)
		}
	}
	return e
}

func eps(descs ...string) []service.Endpoint {
	out := make([]service.Endpoint, len(descs))
	for i, d := range descs {
		out[i] = ep(d)
	}
	return out
}

// render shows a selection as "[addr ...] reason".
func render(s Selection) string {
	addrs := make([]string, len(s.Endpoints))
	for i, a := range s.Endpoints {
		addrs[i] = a.String()
	}
	return "[" + strings.Join(addrs, " ") + "] " + s.Reason
}

func TestSelectEndpoints(t *testing.T) {
	nodeA := NodeTopology{Name: "node-a", Zone: "zone-a"}
	clusterIP := service.Port{Name: service.ServicePortName{Namespace: "ns", Name: "svc"}, Protocol: service.TCP, Port: 80}
	with := func(mutate func(*service.Port)) *service.Port {
		p := clusterIP
		mutate(&p)
		return &p
	}
	itpLocal := with(func(p *service.Port) { p.InternalLocal = true })
	etpLocal := with(func(p *service.Port) { p.ExternalLocal, p.NodePort = true, 30080 })
	itpLocalNodePort := with(func(p *service.Port) { p.InternalLocal, p.NodePort = true, 30080 })
	bothLocal := with(func(p *service.Port) { p.InternalLocal, p.ExternalLocal, p.NodePort = true, true, 30080 })
	fourZones := eps("10.1.2.3:80 ready zones=zone-a", "10.1.2.4:80 ready zones=zone-b",
		"10.1.2.5:80 ready zones=zone-c", "10.1.2.6:80 ready zones=zone-a")
	const (
		none = "[] traffic=none" // External and ExternalFromNode of a port without external addresses
	)

	tests := []struct {
		name string
		port *service.Port
		node NodeTopology
		eps  []service.Endpoint
		// Selections rendered as "[addr ...] reason".
		internal, external, fromNode string
		hasAny                       bool
	}{
		// Topology hints (zones).
		{
			name: "zone_hints_narrow_when_every_endpoint_has_one_and_one_is_for_this_zone",
			port: &clusterIP, node: nodeA, eps: fourZones,
			internal: "[10.1.2.3:80 10.1.2.6:80] policy=Cluster topology=zone:zone-a",
			external: none, fromNode: none, hasAny: true,
		},
		{
			name: "external_local_ignores_hints_for_the_local_set",
			port: etpLocal, node: nodeA,
			eps: eps("10.1.2.3:80 ready local zones=zone-a", "10.1.2.4:80 ready local zones=zone-b",
				"10.1.2.5:80 ready zones=zone-c", "10.1.2.6:80 ready zones=zone-a"),
			internal: "[10.1.2.3:80 10.1.2.6:80] policy=Cluster topology=zone:zone-a",
			external: "[10.1.2.3:80 10.1.2.4:80] policy=Local",
			fromNode: "[10.1.2.3:80 10.1.2.6:80] policy=Cluster topology=zone:zone-a",
			hasAny:   true,
		},
		{
			name: "internal_local_ignores_hints_for_the_local_set",
			port: itpLocalNodePort, node: nodeA,
			eps: eps("10.1.2.3:80 ready local zones=zone-a", "10.1.2.4:80 ready local zones=zone-b",
				"10.1.2.5:80 ready zones=zone-c", "10.1.2.6:80 ready zones=zone-a"),
			internal: "[10.1.2.3:80 10.1.2.4:80] policy=Local",
			external: "[10.1.2.3:80 10.1.2.6:80] policy=Cluster topology=zone:zone-a",
			fromNode: "[10.1.2.3:80 10.1.2.6:80] policy=Cluster topology=zone:zone-a",
			hasAny:   true,
		},
		{
			name: "node_without_zone_label_ignores_zone_hints",
			port: &clusterIP, node: NodeTopology{Name: "node-a"}, eps: eps("10.1.2.3:80 ready zones=zone-a"),
			internal: "[10.1.2.3:80] policy=Cluster hints-ignored=node-zone-unknown",
			external: none, fromNode: none, hasAny: true,
		},
		{
			name: "no_endpoint_hinted_for_this_zone_uses_all",
			port: &clusterIP, node: NodeTopology{Name: "node-a", Zone: "zone-b"}, eps: eps("10.1.2.3:80 ready zones=zone-a"),
			internal: "[10.1.2.3:80] policy=Cluster hints-ignored=no-zone-hint-for:zone-b",
			external: none, fromNode: none, hasAny: true,
		},
		{
			name: "unready_endpoint_in_this_zone_is_left_out",
			port: &clusterIP, node: nodeA,
			eps: eps("10.1.2.3:80 ready zones=zone-a", "10.1.2.4:80 ready zones=zone-b",
				"10.1.2.5:80 ready zones=zone-c", "10.1.2.6:80 zones=zone-a"),
			internal: "[10.1.2.3:80] policy=Cluster topology=zone:zone-a",
			external: none, fromNode: none, hasAny: true,
		},
		{
			name: "only_unready_endpoints_in_this_zone_means_no_narrowing",
			port: &clusterIP, node: nodeA,
			eps: eps("10.1.2.3:80 zones=zone-a", "10.1.2.4:80 ready zones=zone-b",
				"10.1.2.5:80 ready zones=zone-c", "10.1.2.6:80 zones=zone-a"),
			internal: "[10.1.2.4:80 10.1.2.5:80] policy=Cluster hints-ignored=no-zone-hint-for:zone-a",
			external: none, fromNode: none, hasAny: true,
		},
		{
			name: "one_ready_endpoint_without_a_hint_disables_hints",
			port: &clusterIP, node: nodeA,
			eps: eps("10.1.2.3:80 ready zones=zone-a", "10.1.2.4:80 ready zones=zone-b",
				"10.1.2.5:80 ready", "10.1.2.6:80 ready zones=zone-a"),
			internal: "[10.1.2.3:80 10.1.2.4:80 10.1.2.5:80 10.1.2.6:80] policy=Cluster hints-ignored=missing-zone-hint:10.1.2.5:80",
			external: none, fromNode: none, hasAny: true,
		},
		{
			name: "endpoint_hinted_for_several_zones_serves_each",
			port: &clusterIP, node: NodeTopology{Name: "node-a", Zone: "zone-c"},
			eps: eps("10.1.2.3:80 ready zones=zone-a,zone-b,zone-c", "10.1.2.4:80 ready zones=zone-b,zone-c",
				"10.1.2.5:80 ready zones=zone-b,zone-d", "10.1.2.6:80 ready zones=zone-c"),
			internal: "[10.1.2.3:80 10.1.2.4:80 10.1.2.6:80] policy=Cluster topology=zone:zone-c",
			external: none, fromNode: none, hasAny: true,
		},
		{
			name: "topology_and_locality_disagree",
			port: etpLocal, node: nodeA,
			eps: eps("10.0.0.0:80 ready local zones=zone-a", "10.0.0.1:80 ready local zones=zone-b",
				"10.0.0.2:80 ready zones=zone-a", "10.0.0.3:80 ready zones=zone-b"),
			internal: "[10.0.0.0:80 10.0.0.2:80] policy=Cluster topology=zone:zone-a",
			external: "[10.0.0.0:80 10.0.0.1:80] policy=Local",
			fromNode: "[10.0.0.0:80 10.0.0.2:80] policy=Cluster topology=zone:zone-a",
			hasAny:   true,
		},
		{
			name: "topology_not_applied_to_terminating_fallback",
			port: &clusterIP, node: nodeA,
			eps:      eps("10.1.2.3:80 terminating zones=zone-b", "10.1.2.4:80 terminating zones=zone-c"),
			internal: "[10.1.2.3:80 10.1.2.4:80] policy=Cluster fallback=terminating",
			external: none, fromNode: none, hasAny: true,
		},

		// Topology hints (nodes): PreferSameNode publishes node and zone hints.
		{
			name: "node_hints_narrow_to_this_node",
			port: with(func(p *service.Port) { p.TrafficDistribution = service.PreferSameNode }), node: nodeA,
			eps: eps("10.0.0.0:80 ready local nodes=node-a zones=zone-a", "10.0.0.1:80 ready nodes=node-b zones=zone-a",
				"10.0.0.2:80 ready nodes=node-c zones=zone-b"),
			internal: "[10.0.0.0:80] policy=Cluster topology=node:node-a",
			external: none, fromNode: none, hasAny: true,
		},
		{
			name: "no_endpoint_for_this_node_falls_back_to_zone_hints",
			port: with(func(p *service.Port) { p.TrafficDistribution = service.PreferSameNode }), node: nodeA,
			eps:      eps("10.0.0.1:80 ready nodes=node-b zones=zone-a", "10.0.0.2:80 ready nodes=node-c zones=zone-b"),
			internal: "[10.0.0.1:80] policy=Cluster hints-ignored=no-node-hint-for:node-a topology=zone:zone-a",
			external: none, fromNode: none, hasAny: true,
		},
		{
			name: "endpoint_without_node_hint_falls_back_to_zone_hints",
			port: &clusterIP, node: nodeA,
			eps: eps("10.0.0.0:80 ready local nodes=node-a zones=zone-a", "10.0.0.1:80 ready zones=zone-a",
				"10.0.0.2:80 ready nodes=node-c zones=zone-b"),
			internal: "[10.0.0.0:80 10.0.0.1:80] policy=Cluster hints-ignored=missing-node-hint:10.0.0.1:80 topology=zone:zone-a",
			external: none, fromNode: none, hasAny: true,
		},
		{
			name: "node_hints_only_and_none_for_this_node_uses_all",
			port: &clusterIP, node: nodeA,
			eps:      eps("10.0.0.1:80 ready nodes=node-b", "10.0.0.2:80 ready nodes=node-c"),
			internal: "[10.0.0.1:80 10.0.0.2:80] policy=Cluster hints-ignored=no-node-hint-for:node-a",
			external: none, fromNode: none, hasAny: true,
		},
		{
			name: "node_hints_with_unknown_node_name",
			port: &clusterIP, node: NodeTopology{Zone: "zone-a"},
			eps:      eps("10.0.0.1:80 ready nodes=node-b zones=zone-a", "10.0.0.2:80 ready nodes=node-c zones=zone-b"),
			internal: "[10.0.0.1:80] policy=Cluster hints-ignored=node-name-unknown topology=zone:zone-a",
			external: none, fromNode: none, hasAny: true,
		},
		{
			name: "traffic_distribution_without_published_hints_uses_all",
			port: with(func(p *service.Port) { p.TrafficDistribution = service.PreferSameZone }), node: nodeA,
			eps:      eps("10.0.0.1:80 ready", "10.0.0.2:80 ready"),
			internal: "[10.0.0.1:80 10.0.0.2:80] policy=Cluster hints=absent",
			external: none, fromNode: none, hasAny: true,
		},
		{
			name: "prefer_close_is_same_zone",
			port: with(func(p *service.Port) { p.TrafficDistribution = service.PreferClose }), node: nodeA,
			eps:      eps("10.0.0.1:80 ready zones=zone-a", "10.0.0.2:80 ready zones=zone-b"),
			internal: "[10.0.0.1:80] policy=Cluster topology=zone:zone-a",
			external: none, fromNode: none, hasAny: true,
		},

		// internalTrafficPolicy.
		{
			name: "internal_local_without_endpoints", port: itpLocal, node: nodeA,
			internal: "[] policy=Local endpoints=none", external: none, fromNode: none,
		},
		{
			name: "internal_local_with_only_remote_endpoints_refuses",
			port: itpLocal, node: nodeA, eps: eps("10.0.0.0:80 ready", "10.0.0.1:80 ready"),
			internal: "[] policy=Local endpoints=none-on-node", external: none, fromNode: none, hasAny: true,
		},
		{
			name: "internal_local_with_only_local_endpoints",
			port: itpLocal, node: nodeA, eps: eps("10.0.0.0:80 ready local", "10.0.0.1:80 ready local"),
			internal: "[10.0.0.0:80 10.0.0.1:80] policy=Local", external: none, fromNode: none, hasAny: true,
		},
		{
			name: "internal_local_uses_the_local_endpoints",
			port: itpLocal, node: nodeA, eps: eps("10.0.0.0:80 ready local", "10.0.0.1:80 ready"),
			internal: "[10.0.0.0:80] policy=Local", external: none, fromNode: none, hasAny: true,
		},
		{
			name: "internal_local_without_node_name_has_no_local_endpoints",
			port: itpLocal, node: NodeTopology{Zone: "zone-a"}, eps: eps("10.0.0.0:80 ready nonode"),
			internal: "[] policy=Local endpoints=none-on-node", external: none, fromNode: none, hasAny: true,
		},

		// Ready and terminating endpoints under the Cluster policy.
		{
			name: "cluster_no_endpoint_ready", port: &clusterIP, node: nodeA, eps: eps("10.0.0.0:80", "10.0.0.1:80"),
			internal: "[] policy=Cluster endpoints=none", external: none, fromNode: none,
		},
		{
			name: "cluster_uses_the_ready_endpoints", port: &clusterIP, node: nodeA, eps: eps("10.0.0.0:80", "10.0.0.1:80 ready"),
			internal: "[10.0.0.1:80] policy=Cluster", external: none, fromNode: none, hasAny: true,
		},
		{
			name: "cluster_falls_back_to_serving_terminating", port: &clusterIP, node: nodeA,
			eps:      eps("10.0.0.0:80 terminating local", "10.0.0.1:80 terminating", "10.0.0.2:80 terminating notserving"),
			internal: "[10.0.0.0:80 10.0.0.1:80] policy=Cluster fallback=terminating", external: none, fromNode: none, hasAny: true,
		},

		// Both policies on one port.
		{
			name: "internal_local_external_cluster", port: itpLocalNodePort, node: nodeA,
			eps:      eps("10.0.0.0:80 ready local", "10.0.0.1:80 ready"),
			internal: "[10.0.0.0:80] policy=Local",
			external: "[10.0.0.0:80 10.0.0.1:80] policy=Cluster",
			fromNode: "[10.0.0.0:80 10.0.0.1:80] policy=Cluster", hasAny: true,
		},
		{
			name: "internal_cluster_external_local", port: etpLocal, node: nodeA,
			eps:      eps("10.0.0.0:80 ready local", "10.0.0.1:80 ready"),
			internal: "[10.0.0.0:80 10.0.0.1:80] policy=Cluster",
			external: "[10.0.0.0:80] policy=Local",
			fromNode: "[10.0.0.0:80 10.0.0.1:80] policy=Cluster", hasAny: true,
		},
		{
			name: "both_local", port: bothLocal, node: nodeA,
			eps:      eps("10.0.0.0:80 ready local", "10.0.0.1:80 ready"),
			internal: "[10.0.0.0:80] policy=Local",
			external: "[10.0.0.0:80] policy=Local",
			fromNode: "[10.0.0.0:80 10.0.0.1:80] policy=Cluster", hasAny: true,
		},
		{
			name: "both_local_all_remote_refused_except_from_this_node", port: bothLocal, node: nodeA,
			eps:      eps("10.0.0.0:80 ready", "10.0.0.1:80 ready"),
			internal: "[] policy=Local endpoints=none-on-node",
			external: "[] policy=Local endpoints=none-on-node",
			fromNode: "[10.0.0.0:80 10.0.0.1:80] policy=Cluster", hasAny: true,
		},
		{
			name: "both_local_all_remote_and_terminating", port: bothLocal, node: nodeA,
			eps:      eps("10.0.0.0:80 terminating", "10.0.0.1:80 terminating"),
			internal: "[] policy=Local endpoints=none-on-node",
			external: "[] policy=Local endpoints=none-on-node",
			fromNode: "[10.0.0.0:80 10.0.0.1:80] policy=Cluster fallback=terminating", hasAny: true,
		},
		{
			name: "external_local_falls_back_to_local_terminating_independently", port: etpLocal, node: nodeA,
			eps: eps("10.0.0.0:80 ready", "10.0.0.1:80 local", "10.0.0.2:80 terminating local",
				"10.0.0.3:80 terminating"),
			internal: "[10.0.0.0:80] policy=Cluster",
			external: "[10.0.0.2:80] policy=Local fallback=terminating",
			fromNode: "[10.0.0.0:80] policy=Cluster", hasAny: true,
		},
		{
			name: "external_local_ignored_without_external_addresses",
			port: with(func(p *service.Port) { p.ExternalLocal = true }), node: nodeA,
			eps:      eps("10.0.0.0:80 ready", "10.0.0.1:80 ready local"),
			internal: "[10.0.0.0:80 10.0.0.1:80] policy=Cluster", external: none, fromNode: none, hasAny: true,
		},
		{
			name: "external_traffic_by_external_ip_or_load_balancer_ip_alone",
			port: with(func(p *service.Port) {
				p.ExternalLocal = true
				p.LoadBalancerIPs = []netip.Addr{netip.MustParseAddr("198.51.100.1")}
			}), node: nodeA,
			eps:      eps("10.0.0.0:80 ready", "10.0.0.1:80 ready local"),
			internal: "[10.0.0.0:80 10.0.0.1:80] policy=Cluster",
			external: "[10.0.0.1:80] policy=Local",
			fromNode: "[10.0.0.0:80 10.0.0.1:80] policy=Cluster", hasAny: true,
		},
		{
			name: "dual_stack_endpoints_keep_their_order", port: &clusterIP, node: nodeA,
			eps:      eps("10.0.0.1:80 ready zones=zone-a", "[fd00:244::1]:80 ready zones=zone-a", "[fd00:244::2]:80 ready zones=zone-b"),
			internal: "[10.0.0.1:80 [fd00:244::1]:80] policy=Cluster topology=zone:zone-a",
			external: none, fromNode: none, hasAny: true,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := selectEndpoints(tc.port, tc.eps, tc.node)
			for _, c := range []struct{ what, want, got string }{
				{"Internal", tc.internal, render(got.Internal)},
				{"External", tc.external, render(got.External)},
				{"ExternalFromNode", tc.fromNode, render(got.ExternalFromNode)},
			} {
				if c.got != c.want {
					t.Errorf("%s (-want +got):\n- %s\n+ %s", c.what, c.want, c.got)
				}
			}
			if got.HasAnyEndpoints != tc.hasAny {
				t.Errorf("HasAnyEndpoints = %v, want %v", got.HasAnyEndpoints, tc.hasAny)
			}
		})
	}
}

// TestSelectEndpointsNeverLeavesTheNodeUnderLocal checks the one promise of the Local policies
// over many shapes of endpoint set: whatever the conditions and hints, a Local selection holds
// only endpoints on this node.
func TestSelectEndpointsNeverLeavesTheNodeUnderLocal(t *testing.T) {
	port := &service.Port{InternalLocal: true, ExternalLocal: true, NodePort: 30080}
	node := NodeTopology{Name: "node-a", Zone: "zone-a"}
	flags := []string{"ready", "terminating", "terminating notserving", ""}
	where := []string{"local", "", "nonode"}
	hints := []string{"", "zones=zone-a", "nodes=node-a zones=zone-a", "nodes=node-b zones=zone-b"}
	shapes := len(flags) * len(where) * len(hints)
	describe := func(k, n int) string {
		f, w, h := flags[n%len(flags)], where[n/len(flags)%len(where)], hints[n/len(flags)/len(where)]
		return strings.Join(strings.Fields(fmt.Sprintf("10.0.0.%d:80 %s %s %s", k, f, w, h)), " ")
	}
	count := 0
	for i := 0; i < shapes; i++ {
		for j := 0; j < shapes; j++ {
			list := eps(describe(0, i), describe(1, j))
			got := selectEndpoints(port, list, node)
			for _, s := range []Selection{got.Internal, got.External} {
				for _, a := range s.Endpoints {
					if i := slices.IndexFunc(list, func(e service.Endpoint) bool { return e.Addr == a }); list[i].NodeName != node.Name {
						t.Fatalf("endpoints %+v: Local selection %q holds %s, not on %s", list, render(s), a, node.Name)
					}
				}
			}
			count++
		}
	}
	if count == 0 {
		t.Fatal("no endpoint sets tried")
	}
}
