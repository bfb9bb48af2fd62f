package daemon

import (
	"context"
	"net/netip"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/handover"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/conntrack"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// portalMode is what differs between --portal-mode=iptables (iptablesMode) and
// --portal-mode=bind (bindMode); everything else (balancer, sockets, sources, metrics) is shared
// and does not know which one runs. The interface holds what every mode does; what only some do
// is one of the optional interfaces below, which callers find by asserting on the mode, as
// Tailscale's router.Router does. A mode without a capability simply lacks the method, so no
// field can be nil by mistake.
type portalMode interface {
	// Portals programs the portals of the service ports: rules, or addresses on a link.
	Portals() portal.Portals
	// Describe is /debug/rules: the rules or the addresses in force.
	Describe() string
	// Close releases what the mode opened (a netlink socket). Portals stay in place.
	Close() error
}

// natProber is a mode whose portals NAT (iptables): it checks that the node can, and whether
// MASQUERADE takes --random-fully (two iptables-restore runs). Run probes before reopening on a
// fresh start, and after, off the reopen's way, on a restart (the rules in force prove NAT works).
type natProber interface {
	ProbeNAT(ctx context.Context, natProven bool) error
}

// conntracker is a mode whose portals NAT, so removed UDP service ports leave conntrack entries
// to clear.
type conntracker interface {
	Conntrack() conntrack.Interface
}

// kernelCounterReader is a mode with a kernel path: it reads the KUBE-SEP counters.
type kernelCounterReader interface {
	KernelCounters(ctx context.Context) ([]portal.EndpointCounter, error)
}

// steeredReader reads where a previous process's portals send each service port: the proxy
// ports the rules in force point at (iptables), or where the previous process listened (bind
// mode with --bind-state-file).
type steeredReader interface {
	Steered(ctx context.Context) ([]proxier.Seed, error)
}

// hostIPSetter is a mode whose rules DNAT to the node IPs (iptables): it takes the Node object's,
// read after the start.
type hostIPSetter interface {
	SetHostIPs(map[portal.Family]netip.Addr)
}

// listenPlanner is a mode whose sockets listen on the portal addresses themselves (bind mode),
// not on one proxy port each; they bind service IPs before the addresses are local (FREEBIND).
type listenPlanner interface {
	ListenPlan(p *service.Port) []netip.AddrPort
}

// listenStateKeeper keeps where the sockets listen after each sync (bind mode with
// --bind-state-file): the proxier offers the state to the writer, which Run runs.
type listenStateKeeper interface {
	ListenState() *stateWriter
}

// metricsCollector is a mode with metrics of its own.
type metricsCollector interface {
	Collector() prometheus.Collector
}

// newPortalMode builds what --portal-mode needs. It is called by Run, not New, and runs nothing:
// in iptables mode Run calls ProbeNAT.
func newPortalMode(_ context.Context, o *Options, hostIPs map[portal.Family]netip.Addr, events *serviceEvents, inh *handover.Inherited, log logrus.FieldLogger) (portalMode, error) {
	if o.portalMode == "bind" {
		m := newBindMode(o, log)
		if o.bindStateFile != "" {
			return &bindModeWithState{bindMode: m, path: o.bindStateFile, state: newStateWriter(saveBoundSeeds(o.bindStateFile, log))}, nil
		}
		return m, nil
	}
	return newIPTablesMode(o, hostIPs, events, inh, log), nil
}

// proxierHooks are the proxier's settings and dependencies that come from the portal mode.
type proxierHooks struct {
	portals        portal.Portals
	conntrack      conntrack.Interface
	plan           func(*service.Port) []netip.AddrPort
	listenState    func([]proxier.Seed)
	kernelCounters func(ctx context.Context) ([]portal.EndpointCounter, error)
	freeBind       bool
}

// hooksOf asks pm for each capability the proxier uses; a missing one stays nil (or false).
func hooksOf(pm portalMode) proxierHooks {
	h := proxierHooks{portals: pm.Portals()}
	if c, ok := pm.(conntracker); ok {
		h.conntrack = c.Conntrack()
	}
	if lp, ok := pm.(listenPlanner); ok {
		h.plan, h.freeBind = lp.ListenPlan, true
	}
	if k, ok := pm.(listenStateKeeper); ok {
		h.listenState = k.ListenState().Offer
	}
	if k, ok := pm.(kernelCounterReader); ok {
		h.kernelCounters = k.KernelCounters
	}
	return h
}
