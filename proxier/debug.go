package proxier

import (
	"cmp"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// ServiceView is one service port as the debug endpoints and the status page show it.
type ServiceView struct {
	Name            string   `json:"name"`
	Protocol        string   `json:"protocol"`
	Port            uint16   `json:"port"`
	NodePort        uint16   `json:"nodePort,omitempty"`
	ClusterIPs      []string `json:"clusterIPs"`
	ExternalIPs     []string `json:"externalIPs,omitempty"`
	LoadBalancerIPs []string `json:"loadBalancerIPs,omitempty"`
	ProxyPort       uint16   `json:"proxyPort,omitempty"`
	// ExternalProxyPort is the socket of external traffic when a Local policy gives it its own.
	ExternalProxyPort uint16 `json:"externalProxyPort,omitempty"`
	// InternalTrafficPolicy and ExternalTrafficPolicy are Cluster or Local.
	InternalTrafficPolicy string `json:"internalTrafficPolicy"`
	ExternalTrafficPolicy string `json:"externalTrafficPolicy,omitempty"`
	// Internal and External say which endpoints each class of traffic uses on this node and why
	// (policy, topology hints, terminating fallback), and whether it is refused for lack of one.
	Internal                 *TrafficView `json:"internal,omitempty"`
	External                 *TrafficView `json:"external,omitempty"`
	HealthCheckNodePort      uint16       `json:"healthCheckNodePort,omitempty"`
	LoadBalancerSourceRanges []string     `json:"loadBalancerSourceRanges,omitempty"`
	Listen                   []string     `json:"listen,omitempty"`
	Open                     bool         `json:"open"`
	Affinity                 string       `json:"affinity"`
	// Balancing is the policy the annotations ask for (portal-proxy.kubernetes.io/algorithm ...).
	Balancing BalancingView `json:"balancing"`
	// ProxyProtocol is the PROXY protocol header the port's endpoints get ("v1", "v2"; TCP).
	ProxyProtocol string `json:"proxyProtocol,omitempty"`
	// Hold is the port's hold while it has no endpoint, when it has one (hold-timeout; TCP).
	Hold *HoldView `json:"hold,omitempty"`
	// DrainTimeout is the drain-timeout annotation ("" when unset: --drain-removed-endpoints).
	DrainTimeout string `json:"drainTimeout,omitempty"`
	// Draining lists the endpoints out of rotation whose flows wait for their drain deadline.
	Draining        []DrainView    `json:"draining,omitempty"`
	Endpoints       []EndpointView `json:"endpoints"`
	AffinityEntries []AffinityView `json:"affinityEntries,omitempty"`
	Active          int64          `json:"active"`
	Total           uint64         `json:"total"`
	BytesToEndpoint uint64         `json:"bytesToEndpoint"`
	BytesToClient   uint64         `json:"bytesToClient"`
}

// TrafficView is the endpoint selection of one class of traffic.
type TrafficView struct {
	Endpoints []string `json:"endpoints"`
	// Reason is selectEndpoints' account, e.g. "policy=Local fallback=terminating".
	Reason  string `json:"reason"`
	Refused bool   `json:"refused"`
	// Held: it has no endpoint, and new connections wait for one (hold-timeout) instead.
	Held bool `json:"held,omitempty"`
}

// EndpointView is one endpoint with its conditions and whether the balancer uses it.
type EndpointView struct {
	Address     string `json:"address"`
	Ready       bool   `json:"ready"`
	Serving     bool   `json:"serving"`
	Terminating bool   `json:"terminating"`
	InUse       bool   `json:"inUse"`
	Node        string `json:"node,omitempty"`
	Zone        string `json:"zone,omitempty"`
	// Pod is the object behind the endpoint (namespace/name, the EndpointSlice's targetRef).
	Pod string `json:"pod,omitempty"`
	// Hints are the zones and nodes the endpoint is hinted for ("zone:a", "node:n").
	Hints []string `json:"hints,omitempty"`
	// Active is the flows the balancer counts on the endpoint (dials, connections, sessions),
	// what least-connections and random-two-choices compare.
	Active int64 `json:"active"`
	// EjectedFor is how much longer outlier detection keeps it out of rotation ("" when in).
	EjectedFor string `json:"ejectedFor,omitempty"`
	// Ejections is its ejections in a row (the back-off multiplier).
	Ejections int `json:"ejections,omitempty"`
	// WarmingPercent is its share of new connections against a warm endpoint's while it warms
	// up (slow start), in percent; 0 when it is warm.
	WarmingPercent int `json:"warmingPercent,omitempty"`
}

// BalancingView is a service port's load-balancing policy.
type BalancingView struct {
	Algorithm string `json:"algorithm"`
	// The outlier detection settings, when it is on.
	OutlierConsecutiveFailures int    `json:"outlierConsecutiveFailures,omitempty"`
	OutlierEjectionTime        string `json:"outlierEjectionTime,omitempty"`
	OutlierMaxEjectionPercent  int    `json:"outlierMaxEjectionPercent,omitempty"`
	// SlowStart is the warm-up window of new and returning endpoints, when it is on.
	SlowStart string `json:"slowStart,omitempty"`
}

// HoldView is a port's hold of new connections while it has no endpoint.
type HoldView struct {
	Timeout string `json:"timeout"`
	// Limit is how many connections each of its proxy sockets holds at most.
	Limit int `json:"limit"`
	// Held is how many wait now.
	Held int64 `json:"held"`
}

// AffinityView is one sticky client.
type AffinityView struct {
	Client   string `json:"client"`
	Endpoint string `json:"endpoint"`
	IdleFor  string `json:"idleFor"`
}

// ConnView is one live TCP connection or UDP session.
type ConnView struct {
	Service         string `json:"service"`
	Protocol        string `json:"protocol"`
	Client          string `json:"client"`
	Endpoint        string `json:"endpoint"`
	Age             string `json:"age"`
	BytesToEndpoint uint64 `json:"bytesToEndpoint"`
	BytesToClient   uint64 `json:"bytesToClient"`
}

// Services describes every service port the proxier knows, open or not, sorted by name.
func (p *Proxier) Services() []ServiceView {
	open := map[service.ServicePortName]activePort{}
	for _, a := range p.activeList() {
		open[a.port.Name] = a
	}
	p.mu.Lock()
	var ports []*service.Port
	for _, ps := range p.latest {
		ports = append(ports, ps...)
	}
	p.mu.Unlock()
	now := p.cfg.Clock.Now()
	out := make([]ServiceView, 0, len(ports))
	for _, port := range ports {
		v := ServiceView{
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
		p.fillSelection(&v, port)
		v.Balancing = balancingView(port.Balancing)
		connectionPolicyView(&v, port, open)
		if port.DrainTimeout > 0 {
			v.DrainTimeout = port.DrainTimeout.String()
		}
		v.Draining = append(p.drains.views(port.Name, now), p.drains.views(externalName(port.Name), now)...)
		inUse := map[netip.AddrPort]bool{}
		states := map[netip.AddrPort]loadbalancer.EndpointState{}
		for _, key := range []service.ServicePortName{port.Name, externalName(port.Name)} {
			if b := p.deps.Balancer.Lookup(key); b != nil {
				for _, st := range b.EndpointStates() {
					inUse[st.Endpoint] = true
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
		}
		if b := p.deps.Balancer.Lookup(port.Name); b != nil {
			for _, e := range b.AffinityEntries() {
				v.AffinityEntries = append(v.AffinityEntries, AffinityView{Client: e.Client.String(),
					Endpoint: e.Endpoint.String(), IdleFor: now.Sub(e.LastUsed).Round(time.Second).String()})
			}
		}
		// Computed on request from the slice cache: keeping a third copy of every endpoint for a
		// page that is rarely open would cost memory at 50,000 endpoints.
		for _, e := range endpointsFor(port, p.slices.get(port.Name.ServiceName())) {
			ev := EndpointView{Address: e.Addr.String(), Ready: e.Ready, Serving: e.Serving,
				Terminating: e.Terminating, InUse: inUse[e.Addr], Node: e.NodeName, Zone: e.Zone}
			if e.TargetRef.Name != "" {
				ev.Pod = e.TargetRef.String()
			}
			if st, ok := states[e.Addr]; ok {
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
			v.Endpoints = append(v.Endpoints, ev)
		}
		out = append(out, v)
	}
	slices.SortFunc(out, func(a, b ServiceView) int { return cmp.Compare(a.Name, b.Name) })
	return out
}

func fillStats(v *ServiceView, s ProxySocket) {
	if st, ok := socketStats(s); ok {
		v.Active, v.Total = st.Active, st.Total
		v.BytesToEndpoint, v.BytesToClient = st.BytesToEndpoint, st.BytesToClient
	}
}

// Connections lists live TCP connections and UDP sessions, optionally only those of service ports
// whose name contains svc and whose client address contains client.
func (p *Proxier) Connections(svc, client string) []ConnView {
	now := p.cfg.Clock.Now()
	var out []ConnView
	for _, a := range p.activeList() {
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
	slices.SortFunc(out, func(a, b ConnView) int {
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
func (p *Proxier) fillSelection(v *ServiceView, port *service.Port) {
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
	sel := p.selection(port.Name)
	if sel == nil {
		return
	}
	view := func(s Selection, refused bool) *TrafficView {
		t := &TrafficView{Endpoints: []string{}, Reason: s.Reason, Refused: refused}
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
