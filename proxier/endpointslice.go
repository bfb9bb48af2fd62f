package proxier

// endpointslice.go: an EndpointSlice converted once, when its event arrives, into the part the
// proxy uses, and a service port's endpoints read from its Service's slices.

import (
	"net/netip"
	"slices"
	"sort"

	discovery "k8s.io/api/discovery/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// slimSlice is the part of an EndpointSlice the proxy uses, converted once when the event arrives.
type slimSlice struct {
	family    discovery.AddressType
	ports     []slicePort
	endpoints []service.Endpoint // Addr carries port 0; the port comes from ports
}

type slicePort struct {
	name     string
	protocol service.Protocol
	port     uint16
}

// convertSlice extracts addresses, conditions and ports. FQDN slices are not usable by a proxy.
func convertSlice(s *discovery.EndpointSlice) *slimSlice {
	if s.AddressType != discovery.AddressTypeIPv4 && s.AddressType != discovery.AddressTypeIPv6 {
		return &slimSlice{family: s.AddressType}
	}
	out := &slimSlice{family: s.AddressType}
	for _, p := range s.Ports {
		if p.Port == nil || *p.Port <= 0 || *p.Port > 65535 {
			continue
		}
		sp := slicePort{protocol: service.TCP, port: uint16(*p.Port)}
		if p.Name != nil {
			sp.name = *p.Name
		}
		if p.Protocol != nil {
			sp.protocol = service.Protocol(*p.Protocol)
		}
		out.ports = append(out.ports, sp)
	}
	n := 0
	for i := range s.Endpoints {
		n += len(s.Endpoints[i].Addresses)
	}
	out.endpoints = make([]service.Endpoint, 0, n) // one allocation: an Endpoint is ~150 bytes
	hints := hintSets{}
	for _, e := range s.Endpoints {
		base := endpointOf(s.Namespace, &e, hints)
		for _, a := range e.Addresses {
			ip, err := netip.ParseAddr(a)
			if err != nil {
				continue
			}
			ep := base // the hint slices are shared, never modified
			ep.Addr = netip.AddrPortFrom(ip.Unmap(), 0)
			out.endpoints = append(out.endpoints, ep)
		}
	}
	return out
}

// endpointOf converts the address-independent part of one slice endpoint: conditions, where it
// runs, its topology hints and the object behind it.
func endpointOf(namespace string, e *discovery.Endpoint, hints hintSets) service.Endpoint {
	c := e.Conditions
	ready := c.Ready == nil || *c.Ready // nil means unknown, which the API says to treat as ready
	serving := ready
	if c.Serving != nil {
		serving = *c.Serving
	}
	out := service.Endpoint{Ready: ready, Serving: serving, Terminating: c.Terminating != nil && *c.Terminating}
	if e.NodeName != nil {
		out.NodeName = *e.NodeName
	}
	if e.Zone != nil {
		out.Zone = *e.Zone
	}
	if h := e.Hints; h != nil {
		out.ZoneHints = hints.of(len(h.ForZones), func(i int) string { return h.ForZones[i].Name })
		out.NodeHints = hints.of(len(h.ForNodes), func(i int) string { return h.ForNodes[i].Name })
	}
	if r := e.TargetRef; r != nil {
		out.TargetRef = service.NamespacedName{Namespace: r.Namespace, Name: r.Name}
		if out.TargetRef.Namespace == "" {
			out.TargetRef.Namespace = namespace
		}
	}
	return out
}

// hintSets shares the hint slices of one EndpointSlice: its endpoints are mostly hinted for the
// one zone (or node) they are in, so a 1,000-endpoint slice needs a handful of slices, not 1,000.
// Shared slices are never modified.
type hintSets map[string][]string

// of returns the sorted set of the n names name(0..n-1).
func (h hintSets) of(n int, name func(int) string) []string {
	if n == 1 {
		one := name(0)
		if one == "" {
			return nil
		}
		if s, ok := h[one]; ok {
			return s
		}
		s := []string{one}
		h[one] = s
		return s
	}
	names := make([]string, n)
	for i := range names {
		names[i] = name(i)
	}
	return sortedSet(names)
}

// sortedSet sorts names and drops duplicates and empty names (which no node or zone has); nil
// when nothing is left, so "no hints" has one form.
func sortedSet(names []string) []string {
	names = slices.DeleteFunc(names, func(n string) bool { return n == "" })
	if len(names) == 0 {
		return nil
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// endpointsFor merges the slices of one service into the endpoints of one of its ports: ports are
// matched by name and protocol, only the service's IP families are used, duplicates are dropped,
// and serving-terminating endpoints are used only when no endpoint is ready (as kube-proxy does).
// The result is sorted, so equal inputs give equal outputs.
func endpointsFor(p *service.Port, slices []*slimSlice) []service.Endpoint {
	families := map[discovery.AddressType]bool{}
	for _, ip := range p.ClusterIPs {
		if ip.Is4() {
			families[discovery.AddressTypeIPv4] = true
		} else {
			families[discovery.AddressTypeIPv6] = true
		}
	}
	seen := map[netip.AddrPort]int{}
	var all []service.Endpoint
	for _, s := range slices {
		if !families[s.family] {
			continue
		}
		for _, sp := range s.ports {
			if sp.name != p.Name.Port || sp.protocol != p.Protocol {
				continue
			}
			for _, e := range s.endpoints {
				e.Addr = netip.AddrPortFrom(e.Addr.Addr(), sp.port)
				if i, dup := seen[e.Addr]; dup {
					// The same address in two slices (a move in progress): keep the readier view.
					if e.Ready && !all[i].Ready {
						all[i] = e
					}
					continue
				}
				seen[e.Addr] = len(all)
				all = append(all, e)
			}
		}
	}
	sort.Slice(all, func(i, j int) bool { return all[i].Addr.Compare(all[j].Addr) < 0 })
	return all
}

// usableEndpoints picks the addresses the balancer may use: the ready ones, or, when none is
// ready, the ones still serving while terminating.
func usableEndpoints(eps []service.Endpoint) []netip.AddrPort {
	var ready, terminating []netip.AddrPort
	for _, e := range eps {
		switch {
		case e.Ready:
			ready = append(ready, e.Addr)
		case e.Serving && e.Terminating:
			terminating = append(terminating, e.Addr)
		}
	}
	if len(ready) > 0 {
		return ready
	}
	return terminating
}
