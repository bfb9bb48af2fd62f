package daemon

// Address plan: cluster IPs 10.96.0.x and fd00:96::x, an external IP 203.0.113.7, node addresses
// 192.0.2.10 (eth0), 198.51.100.10 (eth1) and 2001:db8::10 (eth0). Nothing is opened.

import (
	"context"
	"net/netip"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	logtest "github.com/sirupsen/logrus/hooks/test"

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

// TestPortalModeCapabilities checks which optional interfaces each --portal-mode has: Run and
// wire find a capability only by asserting on the mode, so a missing method would silently turn
// a feature off (the NAT probe, the reopen after a crash, the bind state file).
func TestPortalModeCapabilities(t *testing.T) {
	tests := []struct {
		args []string
		want []string
	}{{
		args: []string{"--portal-mode=iptables"},
		want: []string{"natProber", "conntracker", "kernelCounterReader", "steeredReader", "hostIPSetter", "metricsCollector"},
	}, {
		args: []string{"--portal-mode=bind"},
		want: []string{"listenPlanner"},
	}, {
		args: []string{"--portal-mode=bind", "--bind-state-file=/nonexistent/state.json"},
		want: []string{"steeredReader", "listenPlanner", "listenStateKeeper"},
	}}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			o, _, err := parseOptions(append(tt.args, "--bind-address=192.0.2.10"))
			if err != nil {
				t.Fatal(err)
			}
			log, _ := logtest.NewNullLogger()
			pm, err := newPortalMode(context.Background(), o, nil, &serviceEvents{}, nil, log)
			if err != nil {
				t.Fatal(err)
			}
			defer pm.Close()
			var got []string
			for name, has := range map[string]bool{
				"natProber":           is[natProber](pm),
				"conntracker":         is[conntracker](pm),
				"kernelCounterReader": is[kernelCounterReader](pm),
				"steeredReader":       is[steeredReader](pm),
				"hostIPSetter":        is[hostIPSetter](pm),
				"listenPlanner":       is[listenPlanner](pm),
				"listenStateKeeper":   is[listenStateKeeper](pm),
				"metricsCollector":    is[metricsCollector](pm),
			} {
				if has {
					got = append(got, name)
				}
			}
			if diff := cmp.Diff(tt.want, got, cmpopts.SortSlices(func(a, b string) bool { return a < b })); diff != "" {
				t.Errorf("capabilities (-want +got):\n%s", diff)
			}
		})
	}
}

func is[T any](pm portalMode) bool { _, ok := pm.(T); return ok }
