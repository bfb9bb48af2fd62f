package iptables

import (
	"net/netip"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan for the rule tests: node 192.168.1.10 and fd00:1::10; cluster IPs 10.96.0.0/16 and
// fd00:96::/112; external IP 203.0.113.7; load-balancer IP 198.51.100.20; proxy ports 3400x.

var (
	nodeV4 = netip.MustParseAddr("192.168.1.10")
	nodeV6 = netip.MustParseAddr("fd00:1::10")
)

var (
	addrs = testenv.Addrs
	spn   = testenv.PortName
)

func webSpec() portal.Spec {
	return portal.Spec{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80,
		ClusterIPs: addrs("10.96.0.10"), ProxyPort: 34001}
}

func v4Config() Config {
	return Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: nodeV4}}
}

func TestGoldenRules(t *testing.T) {
	dual := Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: nodeV4, portal.IPv6: nodeV6}}
	tests := []struct {
		name  string
		cfg   Config
		specs []portal.Spec
	}{
		{name: "empty", cfg: v4Config()},
		{name: "cluster_ip", cfg: v4Config(), specs: []portal.Spec{webSpec()}},
		{name: "multi_port", cfg: v4Config(), specs: []portal.Spec{
			{Name: spn("kube-system", "kube-dns", "dns"), Protocol: service.UDP, Port: 53, ClusterIPs: addrs("10.96.0.10"), ProxyPort: 34002},
			{Name: spn("kube-system", "kube-dns", "dns-tcp"), Protocol: service.TCP, Port: 53, ClusterIPs: addrs("10.96.0.10"), ProxyPort: 34003},
			{Name: spn("default", "kubernetes", "https"), Protocol: service.TCP, Port: 443, ClusterIPs: addrs("10.96.0.1"), ProxyPort: 34004},
		}},
		{name: "external_ips", cfg: v4Config(), specs: []portal.Spec{
			{Name: spn("default", "web", ""), Protocol: service.TCP, Port: 80, ClusterIPs: addrs("10.96.0.10"),
				ExternalIPs: addrs("203.0.113.7", "192.168.1.10"), ProxyPort: 34001},
		}},
		{name: "load_balancer_ips", cfg: v4Config(), specs: []portal.Spec{
			{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, ClusterIPs: addrs("10.96.0.10"),
				LoadBalancerIPs: addrs("198.51.100.20"), ProxyPort: 34001},
		}},
		{name: "node_ports", cfg: v4Config(), specs: []portal.Spec{
			{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080, ClusterIPs: addrs("10.96.0.10"), ProxyPort: 34001},
			{Name: spn("default", "syslog", ""), Protocol: service.UDP, Port: 514, NodePort: 30514, ClusterIPs: addrs("10.96.0.11"), ProxyPort: 34002},
		}},
		{name: "node_port_addresses", cfg: Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: nodeV4, portal.IPv6: nodeV6},
			NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("192.168.1.0/24"), netip.MustParsePrefix("10.0.0.1/8")}},
			specs: []portal.Spec{{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
				ClusterIPs: addrs("10.96.0.10"), ProxyPort: 34001}}},
		{name: "ipv6_dual_stack", cfg: dual, specs: []portal.Spec{
			{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
				ClusterIPs: addrs("10.96.0.10", "fd00:96::10"), ExternalIPs: addrs("2001:db8::7"), ProxyPort: 34001},
		}},
		{name: "bind_address_specific", cfg: Config{BindAddress: nodeV4}, specs: []portal.Spec{
			{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
				ClusterIPs: addrs("10.96.0.10", "fd00:96::10"), ExternalIPs: addrs("203.0.113.7"), ProxyPort: 34001},
		}},
		{name: "bind_address_ipv6_unspecified", cfg: Config{BindAddress: netip.IPv6Unspecified(),
			HostIPs: map[portal.Family]netip.Addr{portal.IPv6: nodeV6}}, specs: []portal.Spec{
			{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80,
				ClusterIPs: addrs("10.96.0.10", "fd00:96::10"), ProxyPort: 34001},
		}},
		{name: "protect_proxy_ports", cfg: Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: nodeV4}, ProtectProxyPorts: true}, specs: []portal.Spec{
			{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080, ClusterIPs: addrs("10.96.0.10"), ProxyPort: 34001},
			{Name: spn("default", "syslog", ""), Protocol: service.UDP, Port: 514, ClusterIPs: addrs("10.96.0.11"), ProxyPort: 34002},
		}},
		// A service port without endpoints: every portal refused in the filter table, nothing steered.
		{name: "reject_no_endpoints", cfg: Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: nodeV4, portal.IPv6: nodeV6}}, specs: []portal.Spec{
			{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
				ClusterIPs: addrs("10.96.0.10", "fd00:96::10"), ExternalIPs: addrs("203.0.113.7"),
				LoadBalancerIPs: addrs("198.51.100.20"), ProxyPort: 34001, RejectInternal: true, RejectExternal: true},
			{Name: spn("default", "syslog", ""), Protocol: service.UDP, Port: 514, ClusterIPs: addrs("10.96.0.11", "fd00:96::11"),
				ProxyPort: 34002, RejectInternal: true, RejectExternal: true},
		}},
		// externalTrafficPolicy: Local without a local endpoint: external traffic is refused, the
		// node's own and cluster traffic still steered.
		{name: "external_local_no_local_endpoints", cfg: v4Config(), specs: []portal.Spec{
			{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
				ClusterIPs: addrs("10.96.0.10"), LoadBalancerIPs: addrs("198.51.100.20"), ProxyPort: 34001,
				ExternalProxyPort: 34011, RejectExternal: true},
		}},
		// externalTrafficPolicy: Local with local endpoints: external portals go to their own socket.
		{name: "external_local", cfg: Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: nodeV4}, ProtectProxyPorts: true}, specs: []portal.Spec{
			{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
				ClusterIPs: addrs("10.96.0.10"), ExternalIPs: addrs("203.0.113.7"), LoadBalancerIPs: addrs("198.51.100.20"),
				ProxyPort: 34001, ExternalProxyPort: 34011},
		}},
		// Pods (--cluster-cidr) reaching an ETP=Local port's external portals are cluster traffic.
		{name: "external_local_pods_as_cluster", cfg: Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: nodeV4},
			PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16"), netip.MustParsePrefix("fd00:244::/64")}}, specs: []portal.Spec{
			{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
				ClusterIPs: addrs("10.96.0.10"), ExternalIPs: addrs("203.0.113.7"), LoadBalancerIPs: addrs("198.51.100.20"),
				ProxyPort: 34001, ExternalProxyPort: 34011},
		}},
		{name: "load_balancer_source_ranges", cfg: Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: nodeV4, portal.IPv6: nodeV6}}, specs: []portal.Spec{
			{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, ClusterIPs: addrs("10.96.0.10"),
				LoadBalancerIPs: addrs("198.51.100.20", "2001:db8::20"), ProxyPort: 34001,
				SourceRanges: []netip.Prefix{netip.MustParsePrefix("10.100.0.0/24"), netip.MustParsePrefix("192.0.2.1/32"),
					netip.MustParsePrefix("2001:db8:1::/48")}},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fake := NewFake()
			p := New(tt.cfg, fake)
			if err := p.Sync(t.Context(), tt.specs); err != nil {
				t.Fatal(err)
			}
			checkGolden(t, tt.name, fake.Dump())
		})
	}
}
