package daemon

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/bind"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// bindMode is --portal-mode=bind: the service IPs are addresses on a link (--portal-interface)
// and the sockets listen on them; no NAT, no rules.
type bindMode struct {
	nl    *bind.Netlink
	addrs *bind.Portals
	iface string
	plan  func(*service.Port) []netip.AddrPort
}

var (
	_ portalMode    = (*bindMode)(nil)
	_ listenPlanner = (*bindMode)(nil)
)

// newBindMode builds the link's address manager; it opens nothing until the first sync.
func newBindMode(o *Options, log logrus.FieldLogger) *bindMode {
	nl := &bind.Netlink{}
	nodeAddrs := proxier.HostNodeIPSources(o.bind, nil, o.portalInterface).InterfaceAddrs
	return &bindMode{nl: nl, addrs: bind.New(bind.Config{Interface: o.portalInterface, Logger: log}, nl),
		iface: o.portalInterface, plan: bindPlan(o.nodePorts, nodeAddrs)}
}

func (m *bindMode) Portals() portal.Portals                     { return m.addrs }
func (m *bindMode) Close() error                                { return m.nl.Close() }
func (m *bindMode) ListenPlan(p *service.Port) []netip.AddrPort { return m.plan(p) }

// Describe lists the service IPs on the portal link.
func (m *bindMode) Describe() string {
	var b strings.Builder
	fmt.Fprintf(&b, "# bind mode: service IPs on %s\n", m.iface)
	for _, a := range m.addrs.Addresses() {
		fmt.Fprintln(&b, a)
	}
	return b.String()
}

// bindModeWithState is bind mode with --bind-state-file: it keeps where the sockets listen, and a
// restart reads where the previous process listened.
type bindModeWithState struct {
	*bindMode
	path  string
	state *stateWriter
}

var (
	_ steeredReader     = (*bindModeWithState)(nil)
	_ listenStateKeeper = (*bindModeWithState)(nil)
)

func (m *bindModeWithState) ListenState() *stateWriter { return m.state }

func (m *bindModeWithState) Steered(ctx context.Context) ([]proxier.Seed, error) {
	return boundSeeds(m.path, localAddrs)(ctx)
}

// bindPlan lists where a service port listens in bind mode: every portal IP at the service port,
// and the node port on the node addresses (--nodeport-addresses, or the wildcard of each family).
func bindPlan(nodePortCIDRs []netip.Prefix, ifaceAddrs map[string][]netip.Addr) func(*service.Port) []netip.AddrPort {
	return func(p *service.Port) []netip.AddrPort {
		var out []netip.AddrPort
		v4, v6 := false, false
		for _, group := range [][]netip.Addr{p.ClusterIPs, p.ExternalIPs, p.LoadBalancerIPs} {
			for _, ip := range group {
				out = append(out, netip.AddrPortFrom(ip, p.Port))
				v4, v6 = v4 || ip.Is4(), v6 || ip.Is6()
			}
		}
		if p.NodePort == 0 {
			return out
		}
		if len(nodePortCIDRs) == 0 {
			if v4 {
				out = append(out, netip.AddrPortFrom(netip.IPv4Unspecified(), p.NodePort))
			}
			if v6 {
				out = append(out, netip.AddrPortFrom(netip.IPv6Unspecified(), p.NodePort))
			}
			return out
		}
		var local []netip.Addr
		for _, addrs := range ifaceAddrs {
			for _, a := range addrs {
				if slices.ContainsFunc(nodePortCIDRs, func(c netip.Prefix) bool { return c.Contains(a) }) {
					local = append(local, a)
				}
			}
		}
		slices.SortFunc(local, netip.Addr.Compare)
		for _, a := range slices.Compact(local) {
			out = append(out, netip.AddrPortFrom(a, p.NodePort))
		}
		return out
	}
}
