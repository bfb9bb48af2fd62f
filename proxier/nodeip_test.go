package proxier

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

func TestNodeIPs(t *testing.T) {
	ifaces := map[string][]netip.Addr{
		"eth0": {netip.MustParseAddr("fe80::1"), netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("2001:db8::10")},
		"eth1": {netip.MustParseAddr("198.51.100.5")},
	}
	tests := []struct {
		name string
		src  NodeIPSources
		want map[portal.Family]string
	}{
		{"bind_address_wins", NodeIPSources{Bind: netip.MustParseAddr("198.51.100.5"), InterfaceAddrs: ifaces,
			DefaultRouteIfaces: map[portal.Family]string{portal.IPv4: "eth0"}},
			map[portal.Family]string{portal.IPv4: "198.51.100.5", portal.IPv6: "2001:db8::10"}},
		{"node_object_next", NodeIPSources{Bind: netip.IPv4Unspecified(), NodeAddresses: []netip.Addr{netip.MustParseAddr("203.0.113.9")},
			InterfaceAddrs: ifaces}, map[portal.Family]string{portal.IPv4: "203.0.113.9", portal.IPv6: "2001:db8::10"}},
		{"default_route_interface", NodeIPSources{InterfaceAddrs: ifaces, DefaultRouteIfaces: map[portal.Family]string{portal.IPv4: "eth1"}},
			map[portal.Family]string{portal.IPv4: "198.51.100.5", portal.IPv6: "2001:db8::10"}},
		{"any_interface_skips_link_local", NodeIPSources{InterfaceAddrs: ifaces},
			map[portal.Family]string{portal.IPv4: "192.0.2.10", portal.IPv6: "2001:db8::10"}},
		{"bind_portal_interface_service_ips_are_not_node_ips", NodeIPSources{InterfaceAddrs: map[string][]netip.Addr{
			"eth0": {netip.MustParseAddr("192.0.2.10")}, "kube-portal0": {netip.MustParseAddr("10.96.0.1")}},
			DefaultRouteIfaces: map[portal.Family]string{portal.IPv4: "kube-portal0"}, Exclude: []string{"kube-portal0"}},
			map[portal.Family]string{portal.IPv4: "192.0.2.10"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := NodeIPs(tc.src)
			if len(got) != len(tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
			for fam, w := range tc.want {
				if got[fam].String() != w {
					t.Errorf("%v: got %v, want %s", fam, got[fam], w)
				}
			}
		})
	}
}

func TestDefaultRoutes(t *testing.T) {
	v4 := "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n" +
		"eth1\t0064A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\n" +
		"eth0\t00000000\t0101A8C0\t0003\t0\t0\t0\t00000000\n"
	if got := defaultRouteV4(strings.NewReader(v4)); got != "eth0" {
		t.Errorf("defaultRouteV4 = %q, want eth0", got)
	}
	v6 := "00000000000000000000000000000000 00 00000000000000000000000000000000 00 fe800000000000000000000000000001 00000400 00000001 00000000 00000003 eth0\n"
	if got := defaultRouteV6(strings.NewReader(v6)); got != "eth0" {
		t.Errorf("defaultRouteV6 = %q, want eth0", got)
	}
}
