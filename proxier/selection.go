package proxier

import (
	"net/netip"
	"slices"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// portSelection is how one service port's traffic is spread on this node right now: the endpoint
// selection, whether its external traffic has a socket of its own, and which classes of traffic
// are refused for lack of an endpoint.
type portSelection struct {
	EndpointSelection
	// split: external traffic (node port, external IPs, load-balancer IPs from outside the node)
	// has its own proxy socket and balancer entry, because a Local policy gives it endpoints that
	// differ from the cluster IP's.
	split bool
	// rejectInternal: the cluster IPs (and, unsplit, every portal) have no endpoint to use.
	// rejectExternal: the external portals have none. A port that holds (Port.Holds) refuses
	// neither.
	rejectInternal, rejectExternal bool
}

// splitsExternal reports whether a port's external traffic needs its own socket: it takes
// external traffic and one of the policies is Local, so the two classes can use different
// endpoints.
func splitsExternal(p *service.Port) bool {
	return p.ExternallyAccessible() && (p.ExternalLocal || p.InternalLocal)
}

func newPortSelection(p *service.Port, sel EndpointSelection) *portSelection {
	ps := &portSelection{EndpointSelection: sel, split: splitsExternal(p)}
	ps.rejectInternal = len(sel.Internal.Endpoints) == 0
	ps.rejectExternal = ps.rejectInternal
	if ps.split {
		ps.rejectExternal = len(sel.External.Endpoints) == 0
	}
	if p.Holds() {
		// The socket holds what finds no endpoint (hold-timeout): the traffic must reach it.
		ps.rejectInternal, ps.rejectExternal = false, false
	}
	return ps
}

// rulesEqual reports whether two selections need the same portals (socket split and refusals).
func (s *portSelection) rulesEqual(o *portSelection) bool {
	return o != nil && s.split == o.split && s.rejectInternal == o.rejectInternal && s.rejectExternal == o.rejectExternal
}

// externalName is the balancer key of a split port's external traffic. The suffix cannot occur in
// a Kubernetes port name (a DNS label), so it never collides with a real port.
func externalName(n service.ServicePortName) service.ServicePortName {
	n.Port += "#external"
	return n
}

// splitPlan divides a bind-mode listen plan into the cluster IP addresses and the external ones.
func splitPlan(p *service.Port, plan []netip.AddrPort) (internal, external []netip.AddrPort) {
	for _, a := range plan {
		if a.Port() == p.Port && slices.Contains(p.ClusterIPs, a.Addr()) {
			internal = append(internal, a)
		} else {
			external = append(external, a)
		}
	}
	return internal, external
}

// selection returns the current selection of a port, or nil.
func (e *endpointApplier) selection(name service.ServicePortName) *portSelection {
	e.selMu.RLock()
	defer e.selMu.RUnlock()
	return e.sels[name]
}

// setSelection records a port's selection and returns the previous one.
func (e *endpointApplier) setSelection(name service.ServicePortName, s *portSelection) *portSelection {
	e.restore.gen.Add(1) // the restart snapshot may have changed
	e.selMu.Lock()
	defer e.selMu.Unlock()
	old := e.sels[name]
	if s == nil {
		delete(e.sels, name)
	} else {
		e.sels[name] = s
	}
	return old
}

// SetNodeTopology changes what endpoint selection knows of this node (its zone label changed)
// and selects every service's endpoints again.
func (p *Proxier) SetNodeTopology(n NodeTopology) {
	p.mu.Lock()
	changed := p.node != n
	p.node = n
	names := make([]service.NamespacedName, 0, len(p.latest))
	for name := range p.latest {
		names = append(names, name)
	}
	p.mu.Unlock()
	if !changed {
		return
	}
	p.log.WithField("node", n.Name).WithField("zone", n.Zone).Info("Node topology changed; selecting endpoints again")
	for _, name := range names {
		p.applyEndpoints(name)
	}
}
