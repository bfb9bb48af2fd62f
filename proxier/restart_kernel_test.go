package proxier

// Address plan: one namespace "node" (10.100.0.1 as the host IP the rules DNAT to, not assigned:
// no packet is sent); cluster IPs 10.96.1.x; proxy ports 34001-34050 as an old process left them.

import (
	"context"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// countingPortals counts syncs of the real portals.
type countingPortals struct {
	portal.Portals
	syncs atomic.Int64
}

func (c *countingPortals) Sync(ctx context.Context, specs []portal.Spec) error {
	c.syncs.Add(1)
	return c.Portals.Sync(ctx, specs)
}

// TestKernelReopenBeforeFirstSync leaves the rules of an "old process" with N service ports in a
// namespace's real iptables, then starts a proxier that has read them back: it listens on the
// same N proxy ports before its first sync (no Service is known yet, so none runs).
func TestKernelReopenBeforeFirstSync(t *testing.T) {
	const n = 50
	lab := netns.NewTestLab(t)
	node := lab.MustAdd(t, "node")
	cfg := iptables.Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: netip.MustParseAddr("10.100.0.1")}, ProtectProxyPorts: true}
	runner := &iptables.ExecRunner{Prefix: node.CommandPrefix()}

	var specs []portal.Spec
	want := map[uint16]service.Protocol{}
	for i := range n {
		proto := service.TCP
		if i%5 == 4 {
			proto = service.UDP
		}
		pp := uint16(34001 + i)
		specs = append(specs, portal.Spec{Name: service.ServicePortName{Namespace: "ns", Name: fmt.Sprintf("s%02d", i), Port: "p"},
			Protocol: proto, Port: 80, ClusterIPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 96, 1, byte(i + 1)})}, ProxyPort: pp})
		want[pp] = proto
	}
	if err := iptables.New(cfg, runner).Sync(t.Context(), specs); err != nil {
		t.Fatalf("the old process's sync: %v", err)
	}

	rules := iptables.New(cfg, runner)
	steered, err := rules.ReadSteered(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	var seeds []Seed
	for _, s := range steered {
		seeds = append(seeds, Seed{Name: s.Name, Protocol: s.Protocol, ProxyPort: s.ProxyPort, ExternalProxyPort: s.ExternalProxyPort, Families: s.Families})
	}
	if len(seeds) != n {
		t.Fatalf("read back %d steered service ports, want %d", len(seeds), n)
	}
	portals := &countingPortals{Portals: rules}
	px := New(Config{}, Deps{Balancer: loadbalancer.New(nil), Portals: portals, Sockets: RealSockets(SocketConfig{})})
	px.Reopen(seeds)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- node.Do(func() error { px.Run(ctx); return nil }) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})

	testenv.WaitFor(t, "the proxy ports the rules point at to be listened on", func() bool {
		got := listeners(t, node)
		for pp, proto := range want {
			if got[pp] != proto {
				return false
			}
		}
		return true
	})
	if s := portals.syncs.Load(); s != 0 {
		t.Errorf("%d portal syncs before any Service was known, want 0", s)
	}
}

// listeners maps the listening TCP and bound UDP ports in ns to their protocol.
func listeners(t *testing.T, ns *netns.NS) map[uint16]service.Protocol {
	t.Helper()
	out := map[uint16]service.Protocol{}
	for _, c := range []struct {
		flag  string
		proto service.Protocol
	}{{"-Hltn", service.TCP}, {"-Hlun", service.UDP}} {
		text := ns.MustExec(t, "ss", c.flag)
		for _, line := range strings.Split(text, "\n") {
			f := strings.Fields(line)
			if len(f) < 4 {
				continue
			}
			local := f[3]
			if p, err := strconv.ParseUint(local[strings.LastIndex(local, ":")+1:], 10, 16); err == nil {
				out[uint16(p)] = c.proto
			}
		}
	}
	return out
}
