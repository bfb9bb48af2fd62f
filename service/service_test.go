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
