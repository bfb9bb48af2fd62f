package daemon

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/handover"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/conntrack"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// iptablesMode is --portal-mode=iptables: portal rules that redirect service traffic to the proxy
// ports (or, on the kernel path, DNAT it to the endpoints), held ports, and conntrack.
type iptablesMode struct {
	runner iptables.Runner
	rules  *iptables.Portals
	held   *portal.Held
	ct     conntrack.Interface
	log    logrus.FieldLogger
}

var (
	_ portalMode          = (*iptablesMode)(nil)
	_ natProber           = (*iptablesMode)(nil)
	_ conntracker         = (*iptablesMode)(nil)
	_ kernelCounterReader = (*iptablesMode)(nil)
	_ steeredReader       = (*iptablesMode)(nil)
	_ hostIPSetter        = (*iptablesMode)(nil)
	_ metricsCollector    = (*iptablesMode)(nil)
)

// newIPTablesMode builds the rules (NoRandomFully until ProbeNAT says otherwise) and the port
// holder; ports the running proxy handed over (inh, nil without) are held on its sockets. It runs
// nothing.
func newIPTablesMode(o *Options, hostIPs map[portal.Family]netip.Addr, events *serviceEvents, inh *handover.Inherited, log logrus.FieldLogger) *iptablesMode {
	m := &iptablesMode{runner: &iptables.ExecRunner{Variant: o.iptablesVariant}, ct: &conntrack.Netlink{}, log: log}
	m.rules = iptables.New(iptables.Config{
		BindAddress: o.bind, HostIPs: hostIPs, NodePortAddresses: o.nodePorts, PodCIDRs: o.podCIDRs,
		ProtectProxyPorts: o.protectProxyPorts, KernelPath: true, ConntrackTCPLiberal: o.conntrackTCPBeLiberal,
		NoRandomFully: true, Logger: log, AfterNATRepair: m.clearUntranslated,
	}, m.runner)
	m.held = &portal.Held{Rules: m.rules, Holder: portal.NewPortHolder(portal.HolderConfig{Logger: log, Listen: holdListen(inh)}), Logger: log,
		OnConflict: func(n service.ServicePortName, err error) { events.Warning(n, "PortConflict", err.Error()) }}
	return m
}

func (m *iptablesMode) Portals() portal.Portals         { return m.held }
func (m *iptablesMode) Describe() string                { return m.rules.Rules() }
func (m *iptablesMode) Close() error                    { return nil }
func (m *iptablesMode) Conntrack() conntrack.Interface  { return m.ct }
func (m *iptablesMode) Collector() prometheus.Collector { return portalCollector(m.rules) }

func (m *iptablesMode) SetHostIPs(ips map[portal.Family]netip.Addr) { m.rules.SetHostIPs(ips) }

func (m *iptablesMode) KernelCounters(ctx context.Context) ([]portal.EndpointCounter, error) {
	return m.rules.KernelCounters(ctx)
}

// Steered reads where the portal rules in force send each service port.
func (m *iptablesMode) Steered(ctx context.Context) ([]proxier.Seed, error) {
	st, err := m.rules.ReadSteered(ctx)
	seeds := make([]proxier.Seed, 0, len(st))
	for _, s := range st {
		seeds = append(seeds, proxier.Seed{Name: s.Name, Protocol: s.Protocol, ProxyPort: s.ProxyPort,
			ExternalProxyPort: s.ExternalProxyPort, Families: s.Families})
	}
	return seeds, err
}

// ProbeNAT checks, unless natProven, that the node can NAT (a node that cannot fails the start,
// with the fix), then whether MASQUERADE takes --random-fully.
func (m *iptablesMode) ProbeNAT(ctx context.Context, natProven bool) error {
	if !natProven {
		if err := iptables.CheckNAT(ctx, m.runner, portal.IPv4); errors.Is(err, iptables.ErrNATUnavailable) {
			return fmt.Errorf("this node cannot NAT, which iptables portals need; run with --portal-mode=bind: %w", err)
		} else if err != nil {
			m.log.WithError(err).Warn("Could not check for NAT support")
		}
	}
	m.rules.SetNoRandomFully(!iptables.HasRandomFully(ctx, m.runner, portal.IPv4))
	return nil
}

// clearUntranslated is iptables.Config.AfterNATRepair: it clears the conntrack entries of
// connections made while a nat flush left the portals' destinations untranslated.
func (m *iptablesMode) clearUntranslated(ctx context.Context, specs []portal.Spec) {
	if err := m.ct.ClearUntranslated(ctx, untranslatedFlows(specs)); err != nil {
		m.log.WithError(err).Warn("Clearing the conntrack entries of connections made while the portal rules were gone")
	}
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
