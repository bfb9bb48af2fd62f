package iptables

import (
	"net/netip"
	"reflect"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan: node 10.100.0.1 / fd00:100::1; cluster IPs in 10.96.0.0/16 and fd00:96::/112;
// external and load-balancer IPs from the documentation ranges.

// TestReadSteered programs specs, reads the rules back as a restarted process would, and expects
// every service port's proxy ports as programmed.
func TestReadSteered(t *testing.T) {
	v4v6 := map[portal.Family]netip.Addr{portal.IPv4: netip.MustParseAddr("10.100.0.1"), portal.IPv6: netip.MustParseAddr("fd00:100::1")}
	tests := []struct {
		name  string
		cfg   Config
		specs []portal.Spec
		want  []Steered
	}{
		{
			name: "cluster_ip_node_port_and_udp",
			cfg:  Config{HostIPs: v4v6, ProtectProxyPorts: true},
			specs: []portal.Spec{
				{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
					ClusterIPs: addrs("10.96.0.10", "fd00:96::10"), ExternalIPs: addrs("203.0.113.7"), ProxyPort: 34001},
				{Name: spn("kube-system", "dns", ""), Protocol: service.UDP, Port: 53, ClusterIPs: addrs("10.96.0.53"), ProxyPort: 34002},
			},
			want: []Steered{
				{Name: spn("default", "web", "http"), Protocol: service.TCP, ProxyPort: 34001, Families: []portal.Family{portal.IPv4, portal.IPv6}},
				{Name: spn("kube-system", "dns", ""), Protocol: service.UDP, ProxyPort: 34002, Families: []portal.Family{portal.IPv4}},
			},
		},
		{
			name: "external_traffic_with_its_own_socket",
			cfg:  Config{HostIPs: v4v6},
			specs: []portal.Spec{{Name: spn("default", "lb", "https"), Protocol: service.TCP, Port: 443, NodePort: 30443,
				ClusterIPs: addrs("10.96.0.11"), LoadBalancerIPs: addrs("198.51.100.20"), ProxyPort: 34010, ExternalProxyPort: 34011}},
			want: []Steered{{Name: spn("default", "lb", "https"), Protocol: service.TCP, ProxyPort: 34010, ExternalProxyPort: 34011,
				Families: []portal.Family{portal.IPv4}}},
		},
		{
			name: "specific_bind_address_dnat",
			cfg:  Config{BindAddress: netip.MustParseAddr("10.100.0.1"), HostIPs: v4v6},
			specs: []portal.Spec{{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80,
				ClusterIPs: addrs("10.96.0.10"), ProxyPort: 34001}},
			want: []Steered{{Name: spn("default", "web", "http"), Protocol: service.TCP, ProxyPort: 34001, Families: []portal.Family{portal.IPv4}}},
		},
		{
			name: "family_not_programmed_not_read",
			cfg:  Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: netip.MustParseAddr("10.100.0.1")}},
			specs: []portal.Spec{{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80,
				ClusterIPs: addrs("10.96.0.10", "fd00:96::10"), ProxyPort: 34001}},
			want: []Steered{{Name: spn("default", "web", "http"), Protocol: service.TCP, ProxyPort: 34001, Families: []portal.Family{portal.IPv4}}},
		},
		{
			name: "refused_port_has_no_steering_rule",
			cfg:  Config{HostIPs: v4v6},
			specs: []portal.Spec{{Name: spn("default", "empty", ""), Protocol: service.TCP, Port: 80,
				ClusterIPs: addrs("10.96.0.12"), ProxyPort: 34020, RejectInternal: true, RejectExternal: true}},
			want: []Steered{},
		},
		{
			name: "only_external_traffic_steered",
			cfg:  Config{HostIPs: v4v6},
			specs: []portal.Spec{{Name: spn("default", "local", ""), Protocol: service.TCP, Port: 80, NodePort: 30081,
				ClusterIPs: addrs("10.96.0.13"), ProxyPort: 34030, ExternalProxyPort: 34031, RejectInternal: true}},
			want: []Steered{{Name: spn("default", "local", ""), Protocol: service.TCP, ProxyPort: 34031, Families: []portal.Family{portal.IPv4}}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fake := NewFake()
			mustSync(t, New(tt.cfg, fake), tt.specs)
			got, err := New(tt.cfg, fake).ReadSteered(t.Context()) // a new process: nothing believed live
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("ReadSteered:\n got %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

func TestParseRule(t *testing.T) {
	tests := []struct {
		body string
		want parsedRule
		ok   bool
	}{
		{`-d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 34001`,
			parsedRule{spn("default", "web", "http"), service.TCP, 34001}, true},
		{`-d fd00:96::10/128 -p udp -m comment --comment "ns/dns" -m udp --dport 53 -j DNAT --to-destination [fd00:100::1]:34002`,
			parsedRule{spn("ns", "dns", ""), service.UDP, 34002}, true},
		{`-m comment --comment "handle ClusterIPs; NOTE: this must be before the NodePort rules" -j KUBE-PORTALS-CONTAINER`, parsedRule{}, false},
		{`-p tcp -m comment --comment "no-slash" -m tcp --dport 80 -j REDIRECT --to-ports 1`, parsedRule{}, false},
		{`-p tcp -m comment --comment "a/b" -m tcp --dport 80 -j REDIRECT --to-ports 0`, parsedRule{}, false},
		// Found by FuzzParseRule (testdata/fuzz/FuzzParseRule/a5c9f12125c93f8d): a DNAT rule
		// that ends after --to-destination panicked the restart's read-back.
		{`-p udp --comment "0/0"-j DNAT --to-destination `, parsedRule{}, false},
		{`-p tcp -m comment --comment "a/b" -j DNAT --to-destination    `, parsedRule{}, false},
		{`-p tcp -m comment --comment "a/b" -j REDIRECT --to-ports `, parsedRule{}, false},
	}
	for _, tt := range tests {
		got, ok := parseRule(tt.body)
		if ok != tt.ok || (ok && got != tt.want) {
			t.Errorf("parseRule(%q) = %+v, %v; want %+v, %v", tt.body, got, ok, tt.want, tt.ok)
		}
	}
}
