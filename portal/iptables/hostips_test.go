package iptables

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// TestSetHostIPs: the daemon builds the portals with the interfaces' address and sets the Node's
// once read (or changed); the next Sync of the same specs rewrites the HOST DNAT rules, and a
// family that had no node IP is programmed once it has one. Address plan: golden_test.go's, and
// 192.168.1.11 / fd00:1::11 as the Node's addresses.
func TestSetHostIPs(t *testing.T) {
	fake := NewFake()
	p := New(Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: nodeV4}}, fake)
	specs := []portal.Spec{{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
		ClusterIPs: addrs("10.96.0.10", "fd00:96::10"), ProxyPort: 34001}}
	if err := p.Sync(t.Context(), specs); err != nil {
		t.Fatal(err)
	}
	if dump := fake.Dump(); !strings.Contains(dump, "--to-destination 192.168.1.10:34001") || strings.Contains(dump, "fd00:96::10") {
		t.Fatalf("before: want HOST DNAT to the interfaces' 192.168.1.10 and no IPv6 portal:\n%s", dump)
	}
	p.SetHostIPs(map[portal.Family]netip.Addr{portal.IPv4: netip.MustParseAddr("192.168.1.11"), portal.IPv6: netip.MustParseAddr("fd00:1::11")})
	if err := p.Sync(t.Context(), specs); err != nil {
		t.Fatal(err)
	}
	dump := fake.Dump()
	for _, want := range []string{"--to-destination 192.168.1.11:34001", "--to-destination [fd00:1::11]:34001", "fd00:96::10"} {
		if !strings.Contains(dump, want) {
			t.Errorf("after SetHostIPs: no %q in\n%s", want, dump)
		}
	}
	if strings.Contains(dump, "192.168.1.10:34001") {
		t.Errorf("after SetHostIPs: the old node IP's rule is still there:\n%s", dump)
	}
}

// TestSetNoRandomFully: a restart builds the portals before it probes for --random-fully (the
// probe runs after the proxy ports are reopened); the next Sync of the same specs takes the
// answer. Address plan: kernelpath_test.go's.
func TestSetNoRandomFully(t *testing.T) {
	fake := NewFake()
	cfg := kernelCfg()
	cfg.NoRandomFully = true
	p := New(cfg, fake)
	specs := []portal.Spec{onKernel(webSpec())}
	if err := p.Sync(t.Context(), specs); err != nil {
		t.Fatal(err)
	}
	if dump := fake.Dump(); !strings.Contains(dump, "-j MASQUERADE") || strings.Contains(dump, "--random-fully") {
		t.Fatalf("before: want MASQUERADE without --random-fully:\n%s", dump)
	}
	p.SetNoRandomFully(false)
	if err := p.Sync(t.Context(), specs); err != nil {
		t.Fatal(err)
	}
	if dump := fake.Dump(); !strings.Contains(dump, "-j MASQUERADE --random-fully") {
		t.Fatalf("after SetNoRandomFully(false): want MASQUERADE --random-fully:\n%s", dump)
	}
}
