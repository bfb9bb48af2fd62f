package daemon

// Address plan: cluster IPs 10.96.0.x and fd00:96::x, an external IP 203.0.113.7, node addresses
// 192.0.2.10 (eth0), 198.51.100.10 (eth1) and 2001:db8::10 (eth0). Nothing is opened.

import (
	"net/netip"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

func TestBindPlan(t *testing.T) {
	addrs := testenv.Addrs
	iface := map[string][]netip.Addr{"eth0": addrs("192.0.2.10", "2001:db8::10"), "eth1": addrs("198.51.100.10")}
	tests := []struct {
		name      string
		nodePorts []string // --nodeport-addresses
		port      service.Port
		want      []string
	}{{
		name: "cluster_and_external_ips_at_the_service_port",
		port: service.Port{Port: 80, ClusterIPs: addrs("10.96.0.10"), ExternalIPs: addrs("203.0.113.7")},
		want: []string{"10.96.0.10:80", "203.0.113.7:80"},
	}, {
		name: "node_port_on_the_wildcard_of_each_family_used",
		port: service.Port{Port: 80, NodePort: 30080, ClusterIPs: addrs("10.96.0.10", "fd00:96::10")},
		want: []string{"10.96.0.10:80", "[fd00:96::10]:80", "0.0.0.0:30080", "[::]:30080"},
	}, {
		name: "ipv4_only_service_gets_no_ipv6_node_port",
		port: service.Port{Port: 53, NodePort: 30053, ClusterIPs: addrs("10.96.0.53")},
		want: []string{"10.96.0.53:53", "0.0.0.0:30053"},
	}, {
		name:      "nodeport_addresses_pick_the_node_addresses_sorted",
		nodePorts: []string{"192.0.2.0/24", "198.51.100.0/24"},
		port:      service.Port{Port: 80, NodePort: 30080, ClusterIPs: addrs("10.96.0.10")},
		want:      []string{"10.96.0.10:80", "192.0.2.10:30080", "198.51.100.10:30080"},
	}, {
		name:      "nodeport_addresses_matching_nothing_leave_only_the_portals",
		nodePorts: []string{"10.200.0.0/16"},
		port:      service.Port{Port: 80, NodePort: 30080, ClusterIPs: addrs("10.96.0.10")},
		want:      []string{"10.96.0.10:80"},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var cidrs []netip.Prefix
			for _, c := range tt.nodePorts {
				cidrs = append(cidrs, netip.MustParsePrefix(c))
			}
			var got []string
			for _, a := range bindPlan(cidrs, iface)(&tt.port) {
				got = append(got, a.String())
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("listen addresses (-want +got):\n%s", diff)
			}
		})
	}
}
