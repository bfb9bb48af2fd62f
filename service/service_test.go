package service

import (
	"net/netip"
	"testing"
	"time"
)

func TestServicePortNameString(t *testing.T) {
	tests := []struct {
		n    ServicePortName
		want string
	}{
		{ServicePortName{Namespace: "default", Name: "kubernetes", Port: "https"}, "default/kubernetes:https"},
		{ServicePortName{Namespace: "ns", Name: "web"}, "ns/web"},
	}
	for _, tc := range tests {
		if got := tc.n.String(); got != tc.want {
			t.Errorf("%#v.String() = %q, want %q", tc.n, got, tc.want)
		}
	}
}

func TestAffinityTTL(t *testing.T) {
	if got := (Affinity{ClientIP: true}).TTL(); got != DefaultAffinityTimeout {
		t.Errorf("zero timeout TTL = %v, want %v", got, DefaultAffinityTimeout)
	}
	if got := (Affinity{ClientIP: true, Timeout: time.Minute}).TTL(); got != time.Minute {
		t.Errorf("TTL = %v, want 1m", got)
	}
}

func TestPortEquality(t *testing.T) {
	base := Port{Name: ServicePortName{Namespace: "ns", Name: "a"}, Protocol: TCP, Port: 80,
		ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.1")}}
	tests := []struct {
		name             string
		mutate           func(*Port)
		equal, sockEqual bool
	}{
		{"same", func(*Port) {}, true, true},
		{"affinity_only", func(p *Port) { p.Affinity = Affinity{ClientIP: true} }, false, true},
		{"traffic_policy_only", func(p *Port) { p.ExternalLocal = true }, false, true},
		{"port", func(p *Port) { p.Port = 81 }, false, false},
		{"external_ip", func(p *Port) { p.ExternalIPs = []netip.Addr{netip.MustParseAddr("203.0.113.1")} }, false, false},
		{"access_log", func(p *Port) { p.AccessLog = true }, false, false},
		{"internal_policy_only", func(p *Port) { p.InternalLocal = true }, false, true},
		{"health_check_node_port_only", func(p *Port) { p.HealthCheckNodePort = 32000 }, false, true},
		{"source_ranges_only", func(p *Port) {
			p.LoadBalancerSourceRanges = []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}
		}, false, true},
		{"traffic_distribution_only", func(p *Port) { p.TrafficDistribution = PreferSameNode }, false, true},
		{"node_port", func(p *Port) { p.NodePort = 30080 }, false, false},
		{"proxy_protocol", func(p *Port) { p.ProxyProtocol = ProxyProtocolV2 }, false, false},
		{"hold_timeout", func(p *Port) { p.HoldTimeout = 30 * time.Second }, false, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o := base
			tc.mutate(&o)
			if got := base.Equal(&o); got != tc.equal {
				t.Errorf("Equal = %v, want %v", got, tc.equal)
			}
			if got := base.SocketEqual(&o); got != tc.sockEqual {
				t.Errorf("SocketEqual = %v, want %v", got, tc.sockEqual)
			}
		})
	}
}

func TestHoldsOnlyTCPWithATimeout(t *testing.T) {
	for _, tc := range []struct {
		p    Port
		want bool
	}{
		{Port{Protocol: TCP, HoldTimeout: time.Second}, true},
		{Port{Protocol: TCP}, false},
		{Port{Protocol: UDP, HoldTimeout: time.Second}, false},
	} {
		if got := tc.p.Holds(); got != tc.want {
			t.Errorf("%s hold %v: Holds() = %v, want %v", tc.p.Protocol, tc.p.HoldTimeout, got, tc.want)
		}
	}
}

func TestExternallyAccessible(t *testing.T) {
	tests := []struct {
		name string
		p    Port
		want bool
	}{
		{"cluster_ip_only", Port{ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.1")}}, false},
		{"node_port", Port{NodePort: 30080}, true},
		{"external_ip", Port{ExternalIPs: []netip.Addr{netip.MustParseAddr("203.0.113.1")}}, true},
		{"load_balancer_ip", Port{LoadBalancerIPs: []netip.Addr{netip.MustParseAddr("198.51.100.1")}}, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.p.ExternallyAccessible(); got != tc.want {
				t.Errorf("ExternallyAccessible = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestEndpointEqualAndHints(t *testing.T) {
	base := Endpoint{Addr: netip.MustParseAddrPort("10.244.1.2:8080"), Ready: true, Serving: true, NodeName: "node-a",
		Zone: "zone-a", ZoneHints: []string{"zone-a", "zone-b"}, NodeHints: []string{"node-a"},
		TargetRef: NamespacedName{Namespace: "ns", Name: "web-0"}}
	tests := []struct {
		name   string
		mutate func(*Endpoint)
		equal  bool
	}{
		{"same", func(*Endpoint) {}, true},
		{"copied_hints", func(e *Endpoint) { e.ZoneHints = []string{"zone-a", "zone-b"} }, true},
		{"zone_hint", func(e *Endpoint) { e.ZoneHints = []string{"zone-a"} }, false},
		{"node_hint_dropped", func(e *Endpoint) { e.NodeHints = nil }, false},
		{"zone", func(e *Endpoint) { e.Zone = "zone-b" }, false},
		{"target_ref", func(e *Endpoint) { e.TargetRef.Name = "web-1" }, false},
		{"terminating", func(e *Endpoint) { e.Terminating = true }, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o := base
			tc.mutate(&o)
			if got := base.Equal(&o); got != tc.equal {
				t.Errorf("Equal = %v, want %v", got, tc.equal)
			}
		})
	}
	for _, z := range []string{"zone-a", "zone-b"} {
		if !base.HasZoneHint(z) {
			t.Errorf("HasZoneHint(%q) = false, want true", z)
		}
	}
	if base.HasZoneHint("zone-c") || base.HasZoneHint("") {
		t.Errorf("HasZoneHint true for a zone not hinted")
	}
	if !base.HasNodeHint("node-a") || base.HasNodeHint("node-b") || (&Endpoint{}).HasNodeHint("") {
		t.Errorf("HasNodeHint wrong: node-a=%v node-b=%v", base.HasNodeHint("node-a"), base.HasNodeHint("node-b"))
	}
}
