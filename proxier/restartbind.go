package proxier

// restartbind.go: the bind-mode side of restart.go. In bind mode the service addresses outlive a
// killed process on the portal link, but no rule says which ports were served on them; the daemon
// keeps that in a state file (Config.ListenState after each sync, Reopen with its content at
// start), and the proxier reopens each port's sockets on the same addresses before the first sync,
// which keeps those whose addresses it still wants.

import (
	"net/netip"
	"slices"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// reopenSeedBound opens, in bind mode, one seed's sockets on the addresses it listened on: the
// cluster (or only) one, then the external one.
func (d *dataPaths) reopenSeedBound(s Seed) (*activePort, error) {
	port := s.boundPort()
	port.SourceMode = d.cfg.defaultSourceMode() // the port's own, if it differs, comes with the first sync
	filter := newSourceFilter(s.SourceRanges)
	sock, err := openAll(s.Listen, d.holdingBuild(port, port.Name, filter))
	if err != nil {
		return nil, err
	}
	a := d.serve(port, sock, port.Port)
	a.filter, a.listen, a.split = filter, slices.Clone(s.Listen), len(s.External) > 0
	if !a.split {
		return a, nil
	}
	ext, err := openAll(s.External, d.holdingBuild(port, externalName(port.Name), filter))
	if err != nil {
		d.closeSocket(a)
		return nil, err
	}
	a.ext = d.serve(port, ext, port.Port)
	a.ext.filter, a.ext.listen = filter, slices.Clone(s.External)
	return a, nil
}

// boundPort is the service port a bind-mode seed's sockets serve until the first sync knows the
// real one: enough of it for the sockets and their source check (allowFor).
func (s Seed) boundPort() *service.Port {
	port := &service.Port{Name: s.Name, Protocol: s.Protocol, Port: s.ProxyPort, LoadBalancerIPs: s.LoadBalancerIPs,
		LoadBalancerSourceRanges: s.SourceRanges}
	for _, a := range s.Listen {
		if a.Port() == s.ProxyPort && !a.Addr().IsUnspecified() && !slices.Contains(s.LoadBalancerIPs, a.Addr()) {
			port.ClusterIPs = append(port.ClusterIPs, a.Addr())
		}
	}
	return port
}

// boundAdoptable reports whether a socket reopened from the bind state listens exactly where the
// real port's sockets would (same split, same addresses), so the first sync keeps it.
func (d *dataPaths) boundAdoptable(a *activePort, port *service.Port) bool {
	internal, external := d.boundPlan(port)
	if a.split != splitsExternal(port) || !sameAddrs(a.listen, internal) {
		return false
	}
	if a.ext == nil {
		return len(external) == 0
	}
	return sameAddrs(a.ext.listen, external)
}

// boundPlan is where a port's sockets listen in bind mode: all of the plan on one socket, or the
// cluster IPs on one and the rest on the external socket when the port splits its traffic.
func (d *dataPaths) boundPlan(port *service.Port) (internal, external []netip.AddrPort) {
	plan := d.cfg.ListenPlan(port)
	if splitsExternal(port) {
		return splitPlan(port, plan)
	}
	return plan, nil
}

func sameAddrs(a, b []netip.AddrPort) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.SortFunc(a, netip.AddrPort.Compare)
	slices.SortFunc(b, netip.AddrPort.Compare)
	return slices.Equal(a, b)
}

// listenState lists, in bind mode, where every open service port listens (in no order), for the
// state file a restarted process reopens from. A port whose cluster socket refuses (no endpoint) is left out:
// after a restart nothing should listen there either.
func (d *dataPaths) listenState() []Seed {
	d.mu.RLock()
	defer d.mu.RUnlock()
	out := make([]Seed, 0, len(d.byName))
	for _, a := range d.socketPaths() {
		if a.refusing {
			continue
		}
		s := Seed{Name: a.port.Name, Protocol: a.port.Protocol, ProxyPort: a.port.Port,
			LoadBalancerIPs: a.port.LoadBalancerIPs, SourceRanges: a.port.LoadBalancerSourceRanges}
		internal, external := d.boundPlan(a.port)
		if a.split != splitsExternal(a.port) {
			continue // reopens at the next sync (reconcileSplits); saved then
		}
		s.Listen = internal
		if a.ext != nil {
			s.External = external
		}
		out = append(out, s)
	}
	return out
}

// saveListenState hands the bind-mode listen state to Config.ListenState after a sync that worked
// and changed something (the caller checks), so a periodic sync of 10,000 ports costs nothing.
func (d *dataPaths) saveListenState() {
	d.eps.restore.gen.Add(1) // a sync changed sockets: the restart snapshot's proxy ports may differ
	if d.cfg.ListenPlan == nil || d.cfg.ListenState == nil {
		return
	}
	d.cfg.ListenState(d.listenState())
}
