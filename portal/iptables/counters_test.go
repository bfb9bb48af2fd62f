package iptables

import (
	"net/netip"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// TestKernelCounters reads the KUBE-SEP counters through the fake: one read per interval, none
// while no port is on the kernel path.
func TestKernelCounters(t *testing.T) {
	fake := NewFake()
	clk := clocktesting.NewFakePassiveClock(time.Unix(1000, 0))
	cfg := kernelCfg()
	cfg.Clock, cfg.CounterInterval = clk, 5*time.Second
	p := New(cfg, fake)

	mustSync(t, p, []portal.Spec{dnsSpec()})
	before := fake.Counts().Saves
	if got, err := p.KernelCounters(t.Context()); err != nil || got != nil {
		t.Fatalf("no kernel port: %v, %v; want nothing", got, err)
	}
	if fake.Counts().Saves != before {
		t.Error("KernelCounters read the tables although no port is on the kernel path")
	}

	mustSync(t, p, []portal.Spec{onKernel(webSpec()), dnsSpec()})
	fake.mu.Lock()
	fake.Counters = map[string][2]uint64{
		`KUBE-SEP-OAIGUPJHOE4YU7HS -p tcp -m comment --comment "default/web:http" -m tcp -j DNAT --to-destination 10.244.2.5:8080`: {7, 420},
	}
	fake.mu.Unlock()
	got, err := p.KernelCounters(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	want := map[netip.AddrPort][2]uint64{
		netip.MustParseAddrPort("10.244.1.5:8080"): {0, 0},
		netip.MustParseAddrPort("10.244.2.5:8080"): {7, 420},
	}
	if len(got) != len(want) {
		t.Fatalf("counters %+v, want %d endpoints", got, len(want))
	}
	for _, c := range got {
		if w := want[c.Endpoint]; c.Packets != w[0] || c.Bytes != w[1] || c.Name != spn("default", "web", "http") || c.Protocol != service.TCP {
			t.Errorf("counter %+v, want %v packets/bytes of default/web:http TCP", c, w)
		}
	}
	saves := fake.Counts().Saves
	if _, err := p.KernelCounters(t.Context()); err != nil || fake.Counts().Saves != saves {
		t.Errorf("a second read within the interval ran iptables-save again")
	}
	clk.SetTime(clk.Now().Add(5 * time.Second))
	if _, err := p.KernelCounters(t.Context()); err != nil || fake.Counts().Saves != saves+1 {
		t.Errorf("a read after the interval: %d saves, want %d", fake.Counts().Saves, saves+1)
	}
}
