package daemon

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/handover"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/bind"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/conntrack"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// portalMode is what differs between --portal-mode=iptables and --portal-mode=bind; everything
// else (balancer, sockets, sources, metrics) is shared and does not know which one runs.
type portalMode struct {
	portals   portal.Portals
	conntrack conntrack.Interface                  // nil: no NAT, no conntrack entries to clear
	plan      func(*service.Port) []netip.AddrPort // nil: one proxy socket per port, on a local port
	freeBind  bool                                 // sockets bind service IPs before they are local
	collector prometheus.Collector                 // mode-specific metrics, or nil
	describe  func() string                        // /debug/rules
	// kernelCounters reads the kernel path's KUBE-SEP counters; nil in bind mode (no kernel path).
	kernelCounters func(ctx context.Context) ([]portal.EndpointCounter, error)
	// steered reads the proxy ports the portal rules in force point at (a previous process's),
	// or in bind mode where the previous process listened (--bind-state-file); nil: nothing to read.
	steered func(ctx context.Context) ([]proxier.Seed, error)
	// setHostIPs replaces the node IPs the portal rules DNAT to (the Node object's, read after
	// the start); nil in bind mode, which has no such rules.
	setHostIPs func(map[portal.Family]netip.Addr)
	// probe checks, in iptables mode, that the node can NAT and whether MASQUERADE takes
	// --random-fully (two iptables-restore runs). Run does it before reopening on a fresh start,
	// and after, off the reopen's way, on a restart (the rules in force prove NAT works); nil:
	// nothing to probe.
	probe func(ctx context.Context, natProven bool) error
	// state keeps, in bind mode, where the sockets listen after each sync; nil: not kept.
	state *stateWriter
	close func()
}

// newPortalMode builds what --portal-mode needs. It is called by Run, not New. In iptables mode
// it runs nothing: Run calls probe (can the node NAT, does MASQUERADE take --random-fully).
func newPortalMode(ctx context.Context, o *Options, hostIPs map[portal.Family]netip.Addr, events *serviceEvents, inh *handover.Inherited, log logrus.FieldLogger) (*portalMode, error) {
	if o.portalMode == "bind" {
		nl := &bind.Netlink{}
		b := bind.New(bind.Config{Interface: o.portalInterface, Logger: log}, nl)
		nodeAddrs := proxier.HostNodeIPSources(o.bind, nil, o.portalInterface).InterfaceAddrs
		var steered func(context.Context) ([]proxier.Seed, error)
		var state *stateWriter
		if o.bindStateFile != "" {
			steered, state = boundSeeds(o.bindStateFile, localAddrs), newStateWriter(saveBoundSeeds(o.bindStateFile, log))
		}
		return &portalMode{
			steered:  steered,
			state:    state,
			portals:  b,
			plan:     bindPlan(o.nodePorts, nodeAddrs),
			freeBind: true,
			describe: func() string {
				var b2 strings.Builder
				fmt.Fprintf(&b2, "# bind mode: service IPs on %s\n", o.portalInterface)
				for _, a := range b.Addresses() {
					fmt.Fprintln(&b2, a)
				}
				return b2.String()
			},
			close: func() { _ = nl.Close() },
		}, nil
	}
	runner := &iptables.ExecRunner{Variant: o.iptablesVariant}
	ct := &conntrack.Netlink{}
	// NoRandomFully until the probe says otherwise (Run probes before the first sync).
	rules := iptables.New(iptables.Config{
		BindAddress: o.bind, HostIPs: hostIPs, NodePortAddresses: o.nodePorts, PodCIDRs: o.podCIDRs,
		ProtectProxyPorts: o.protectProxyPorts, KernelPath: true, ConntrackTCPLiberal: o.conntrackTCPBeLiberal,
		NoRandomFully: true, Logger: log,
		AfterNATRepair: func(ctx context.Context, specs []portal.Spec) {
			if err := ct.ClearUntranslated(ctx, untranslatedFlows(specs)); err != nil {
				log.WithError(err).Warn("Clearing the conntrack entries of connections made while the portal rules were gone")
			}
		},
	}, runner)
	return &portalMode{
		portals: &portal.Held{Rules: rules, Holder: portal.NewPortHolder(portal.HolderConfig{Logger: log, Listen: holdListen(inh)}), Logger: log,
			OnConflict: func(n service.ServicePortName, err error) { events.Warning(n, "PortConflict", err.Error()) }},
		conntrack:      ct,
		collector:      portalCollector(rules),
		describe:       rules.Rules,
		kernelCounters: rules.KernelCounters,
		steered:        steeredSeeds(rules),
		setHostIPs:     rules.SetHostIPs,
		probe: func(ctx context.Context, natProven bool) error {
			if !natProven {
				if err := iptables.CheckNAT(ctx, runner, portal.IPv4); errors.Is(err, iptables.ErrNATUnavailable) {
					return fmt.Errorf("this node cannot NAT, which iptables portals need; run with --portal-mode=bind: %w", err)
				} else if err != nil {
					log.WithError(err).Warn("Could not check for NAT support")
				}
			}
			rules.SetNoRandomFully(!iptables.HasRandomFully(ctx, runner, portal.IPv4))
			return nil
		},
		close: func() {},
	}, nil
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

// listenState is the proxier's Config.ListenState: nil unless the bind state is kept.
func (pm *portalMode) listenState() func([]proxier.Seed) {
	if pm.state == nil {
		return nil
	}
	return pm.state.Offer
}

// untranslatedFlows are the portal destinations of specs, for clearing the conntrack entries
// that a nat flush left untranslated (iptables.Config.AfterNATRepair).
func untranslatedFlows(specs []portal.Spec) []conntrack.Flows {
	out := make([]conntrack.Flows, 0, len(specs))
	for i := range specs {
		out = append(out, conntrack.FlowsOfSpec(&specs[i]))
	}
	return out
}
