package transparent

import (
	"net/netip"
	"testing"
)

func TestPolicy(t *testing.T) {
	a := netip.MustParseAddr
	p := NewPolicy()
	if p.Transparent(a("10.244.1.10"), a("10.244.2.20")) {
		t.Fatal("a policy without pod CIDRs said transparent")
	}
	p.SetPodCIDRs([]netip.Prefix{netip.MustParsePrefix("10.244.1.7/24"), netip.MustParsePrefix("fd00:1::/64")})
	p.SetLocalAddrs([]netip.Addr{a("10.244.1.1"), a("172.31.0.1"), a("fd00:1::1")})
	cases := []struct {
		name             string
		client, endpoint string
		bridge, want     bool
	}{
		{"pod of this node to a pod of another", "10.244.1.10", "10.244.2.20", false, true},
		{"client on another node to a pod of this node", "172.31.0.2", "10.244.1.20", false, true},
		{"pod to pod of this node without the bridge part", "10.244.1.10", "10.244.1.20", false, false},
		{"pod to pod of this node with the bridge part", "10.244.1.10", "10.244.1.20", true, true},
		{"neither on this node: the reply would not come back", "172.31.0.2", "10.244.2.20", true, false},
		{"hairpin", "10.244.1.10", "10.244.1.10", true, false},
		{"client is this node (bridge address)", "10.244.1.1", "10.244.2.20", true, false},
		{"client is this node (node IP)", "172.31.0.1", "10.244.1.20", true, false},
		{"endpoint is this node (host network)", "10.244.1.10", "172.31.0.1", true, false},
		{"loopback client", "127.0.0.1", "10.244.1.20", true, false},
		{"families differ", "fd00:1::10", "10.244.2.20", true, false},
		{"IPv6 pod of this node to a pod of another", "fd00:1::10", "fd00:2::20", false, true},
		{"IPv4-mapped client", "::ffff:10.244.1.10", "10.244.2.20", false, true},
		{"invalid client", "", "10.244.2.20", true, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p.SetBridge(c.bridge)
			var client netip.Addr
			if c.client != "" {
				client = a(c.client)
			}
			if got := p.Transparent(client, a(c.endpoint)); got != c.want {
				t.Errorf("Transparent(%s, %s) with bridge %v = %v, want %v", c.client, c.endpoint, c.bridge, got, c.want)
			}
		})
	}
	if got := p.PodCIDRs(); len(got) != 2 || got[0] != netip.MustParsePrefix("10.244.1.0/24") {
		t.Errorf("PodCIDRs() = %v, want the masked prefixes", got)
	}
}

func BenchmarkPolicyTransparent(b *testing.B) {
	p := NewPolicy()
	p.SetPodCIDRs([]netip.Prefix{netip.MustParsePrefix("10.244.1.0/24"), netip.MustParsePrefix("fd00:1::/64")})
	p.SetLocalAddrs([]netip.Addr{netip.MustParseAddr("10.244.1.1"), netip.MustParseAddr("172.31.0.1")})
	c, e := netip.MustParseAddr("10.244.1.10"), netip.MustParseAddr("10.244.2.20")
	for b.Loop() {
		if !p.Transparent(c, e) {
			b.Fatal("not transparent")
		}
	}
}
