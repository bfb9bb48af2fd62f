package proxier

import (
	"cmp"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/debugview"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// The debug endpoints and the status page (package debugview) show what these build.
var _ debugview.Source = (*Proxier)(nil)

// Services describes every service port the proxier knows, open or not, sorted by name.
func (p *Proxier) Services() []debugview.ServiceView {
	open := map[service.ServicePortName]activePort{}
	for _, a := range p.paths.activeList() {
		open[a.port.Name] = a
	}
	p.mu.Lock()
	var ports []*service.Port
	for _, ps := range p.latest {
		ports = append(ports, ps...)
	}
	p.mu.Unlock()
	now := p.cfg.Clock.Now()
	counters := p.kernelCounters()
	out := make([]debugview.ServiceView, 0, len(ports))
	for _, port := range ports {
		v := p.serviceView(port, open, now)
		if v.DataPath == string(service.DataPathKernel) {
			v.Kernel = counters[port.Name]
		}
		out = append(out, v)
	}
	slices.SortFunc(out, func(a, b debugview.ServiceView) int { return cmp.Compare(a.Name, b.Name) })
	return out
}

// serviceView describes one service port: its addresses and policies, its sockets, its
// endpoint selection and each endpoint with the balancer's state of it.
func (p *Proxier) serviceView(port *service.Port, open map[service.ServicePortName]activePort, now time.Time) debugview.ServiceView {
	v := debugview.ServiceView{
		Name: port.Name.String(), Protocol: string(port.Protocol), Port: port.Port, NodePort: port.NodePort,
		ClusterIPs: addrStrings(port.ClusterIPs), ExternalIPs: addrStrings(port.ExternalIPs),
		LoadBalancerIPs: addrStrings(port.LoadBalancerIPs), Affinity: "None",
	}
	if port.Affinity.ClientIP {
		v.Affinity = "ClientIP " + port.Affinity.TTL().String()
	}
	if a, ok := open[port.Name]; ok {
		v.Open, v.ProxyPort = true, a.proxyPort
		v.Listen = listenAddrs(a.observedSocket())
		fillStats(&v, a.observedSocket())
		if a.ext != nil {
			v.ExternalProxyPort = a.ext.proxyPort
		}
	}
	v.DataPath = string(p.DataPathOf(port.Name))
	fillSelection(&v, port, p.eps.selection(port.Name))
	v.Balancing = balancingView(port.Balancing)
	connectionPolicyView(&v, port, open)
	if port.DrainTimeout > 0 {
		v.DrainTimeout = port.DrainTimeout.String()
	}
	v.Draining = append(p.eps.drains.views(port.Name, now), p.eps.drains.views(externalName(port.Name), now)...)
	if b := p.deps.Balancer.Lookup(port.Name); b != nil {
		for _, e := range b.AffinityEntries() {
			v.AffinityEntries = append(v.AffinityEntries, debugview.AffinityView{Client: e.Client.String(),
				Endpoint: e.Endpoint.String(), IdleFor: now.Sub(e.LastUsed).Round(time.Second).String()})
		}
	}
	// Computed on request from the slice cache: keeping a third copy of every endpoint for a
	// page that is rarely open would cost memory at 50,000 endpoints.
	eps := endpointsFor(port, p.slices.get(port.Name.ServiceName()))
	v.Endpoints = endpointViews(eps, endpointStates(p.deps.Balancer, port.Name), now)
	return v
}

// endpointStates sums the balancer's state of each endpoint over a port's balancer entries
// (cluster and external traffic); an endpoint in neither is not in use.
func endpointStates(lb *loadbalancer.LoadBalancer, name service.ServicePortName) map[netip.AddrPort]loadbalancer.EndpointState {
	states := map[netip.AddrPort]loadbalancer.EndpointState{}
	for _, key := range []service.ServicePortName{name, externalName(name)} {
		b := lb.Lookup(key)
		if b == nil {
			continue
		}
		for _, st := range b.EndpointStates() {
			sum := states[st.Endpoint]
			sum.Active += st.Active
			if st.EjectedUntil.After(sum.EjectedUntil) {
				sum.EjectedUntil, sum.Ejections = st.EjectedUntil, st.Ejections
			}
			if sum.Weight == 0 || st.Weight < sum.Weight {
				sum.Weight = st.Weight
			}
			states[st.Endpoint] = sum
		}
	}
	return states
}

// endpointViews describes a port's endpoints with their balancer states.
func endpointViews(eps []service.Endpoint, states map[netip.AddrPort]loadbalancer.EndpointState, now time.Time) []debugview.EndpointView {
	var out []debugview.EndpointView
	for _, e := range eps {
		st, inUse := states[e.Addr]
		ev := debugview.EndpointView{Address: e.Addr.String(), Ready: e.Ready, Serving: e.Serving,
			Terminating: e.Terminating, InUse: inUse, Node: e.NodeName, Zone: e.Zone}
		if e.TargetRef.Name != "" {
			ev.Pod = e.TargetRef.String()
		}
		if inUse {
			ev.Active, ev.Ejections = st.Active, st.Ejections
			if st.Weight < 1 {
				ev.WarmingPercent = int(st.Weight * 100)
			}
			if st.EjectedUntil.After(now) {
				ev.EjectedFor = st.EjectedUntil.Sub(now).Round(time.Second).String()
			}
		}
		for _, z := range e.ZoneHints {
			ev.Hints = append(ev.Hints, "zone:"+z)
		}
		for _, n := range e.NodeHints {
			ev.Hints = append(ev.Hints, "node:"+n)
		}
		out = append(out, ev)
	}
	return out
}

func fillStats(v *debugview.ServiceView, s ProxySocket) {
	if st, ok := socketStats(s); ok {
		v.Active, v.Total = st.Active, st.Total
		v.BytesToEndpoint, v.BytesToClient = st.BytesToEndpoint, st.BytesToClient
	}
}

// Connections lists live TCP connections and UDP sessions, optionally only those of service ports
// whose name contains svc and whose client address contains client.
func (p *Proxier) Connections(svc, client string) []debugview.ConnView {
	now := p.cfg.Clock.Now()
	var out []debugview.ConnView
	for _, a := range p.paths.activeList() {
		name := a.port.Name.String()
		if svc != "" && !strings.Contains(name, svc) {
			continue
		}
		for _, c := range connViews(a.observedSocket(), name, string(a.port.Protocol), now) {
			if client == "" || strings.Contains(c.Client, client) {
				out = append(out, c)
			}
		}
	}
	slices.SortFunc(out, func(a, b debugview.ConnView) int {
		return cmp.Or(cmp.Compare(a.Service, b.Service), cmp.Compare(a.Client, b.Client))
	})
	return out
}

func addrStrings(a []netip.Addr) []string {
	out := make([]string, len(a))
	for i, x := range a {
		out[i] = x.String()
	}
	return out
}

// ServiceUID is the UID of a Service the proxier serves, or "" (for events).
func (p *Proxier) ServiceUID(name service.NamespacedName) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, port := range p.latest[name] {
		return port.UID
	}
	return ""
}

// fillSelection adds a port's policies and the endpoint selection of each class of traffic.
func fillSelection(v *debugview.ServiceView, port *service.Port, sel *portSelection) {
	policy := func(local bool) string {
		if local {
			return "Local"
		}
		return "Cluster"
	}
	v.InternalTrafficPolicy = policy(port.InternalLocal)
	v.HealthCheckNodePort = port.HealthCheckNodePort
	for _, r := range port.LoadBalancerSourceRanges {
		v.LoadBalancerSourceRanges = append(v.LoadBalancerSourceRanges, r.String())
	}
	if port.ExternallyAccessible() {
		v.ExternalTrafficPolicy = policy(port.ExternalLocal)
	}
	if sel == nil {
		return
	}
	view := func(s Selection, refused bool) *debugview.TrafficView {
		t := &debugview.TrafficView{Endpoints: []string{}, Reason: s.Reason, Refused: refused}
		for _, ep := range s.Endpoints {
			t.Endpoints = append(t.Endpoints, ep.String())
		}
		return t
	}
	v.Internal = view(sel.Internal, sel.rejectInternal)
	if port.ExternallyAccessible() {
		ext := sel.Internal
		if sel.split {
			ext = sel.External
		}
		v.External = view(ext, sel.rejectExternal)
	}
}
