package proxier

import (
	"net/netip"
	"strings"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// NodeTopology is what endpoint selection needs to know about the node the proxy runs on.
type NodeTopology struct {
	// Name is the node name (--hostname-override). Empty: no endpoint counts as local.
	Name string
	// Zone is the Node's topology.kubernetes.io/zone label. Empty: zone hints are ignored.
	Zone string
}

// Selection is the endpoints one kind of traffic may use, and why.
type Selection struct {
	// Endpoints are the addresses the balancer may pick, in the order given. Empty means the
	// traffic is refused here; it is never sent to an endpoint outside the selection. Two
	// selections may share this slice: read it, do not modify it.
	Endpoints []netip.AddrPort
	// Reason is a short machine-readable account of the choice: space-separated key=value
	// tokens, e.g. "policy=Cluster topology=zone:zone-a" or "policy=Local fallback=terminating"
	// (see selectEndpoints).
	Reason string
}

// pickWhy is what the selection tells the flow stream about every pick from it (flow.PickWhy):
// topology hints narrowed it, a Local policy limited it to this node, or only terminating
// endpoints were left.
func (s Selection) pickWhy() flow.PickWhy {
	var why flow.PickWhy
	for _, tok := range strings.Fields(s.Reason) {
		switch {
		case strings.HasPrefix(tok, "topology="):
			why |= flow.Topology
		case tok == "policy=Local":
			why |= flow.Local
		case tok == "fallback=terminating":
			why |= flow.Terminating
		}
	}
	return why
}

// EndpointSelection is how one service port's traffic is spread on this node.
type EndpointSelection struct {
	// Internal is for traffic to the cluster IPs (internalTrafficPolicy).
	Internal Selection
	// External is for traffic from other hosts to the node port, external IPs and load-balancer
	// IPs (externalTrafficPolicy). Empty, with the reason traffic=none, when the port has none
	// of those addresses.
	External Selection
	// ExternalFromNode is for traffic to those external addresses that starts on this node (the
	// node itself or one of its pods): kube-proxy sends it by the Cluster policy even under
	// externalTrafficPolicy Local, since no client address needs preserving and a local client
	// should reach the service as well as a remote one does. Like External when the port has
	// no external addresses.
	ExternalFromNode Selection
	// HasAnyEndpoints reports whether some endpoint is usable anywhere in the cluster. When a
	// Local selection is empty and this is true, kube-proxy drops rather than rejects, so that
	// a load balancer's retry can find a node that has an endpoint.
	HasAnyEndpoints bool
}

// selectEndpoints decides which of a service port's endpoints each kind of traffic uses on this
// node, as kube-proxy's CategorizeEndpoints does (kubernetes v1.36):
//
//   - An endpoint is usable when ready; when no endpoint of a set is ready, the serving and
//     terminating ones are used instead (KEP-1669), for the Cluster and Local sets separately.
//   - The Cluster set follows topology hints (KEP-2433, KEP-4444, KEP-3015): if every ready
//     endpoint has a node hint and one names this node, only endpoints hinted for this node;
//     otherwise, if every ready endpoint has a zone hint and one names this node's zone, only
//     endpoints hinted for this zone; otherwise all. spec.trafficDistribution itself is not
//     read: the EndpointSlice controller turns it into those hints (PreferSameNode sets both
//     node and zone hints, so an older proxy still keeps traffic in the zone).
//   - The Local set (internalTrafficPolicy or externalTrafficPolicy Local, KEP-2086) is the
//     endpoints on this node, hints ignored; with none, the traffic has no endpoint at all.
//
// eps must hold every endpoint of the port (endpointsFor). Reason tokens:
//
//	policy=Cluster|Local        which set
//	topology=node:N|zone:Z      hints narrowed the Cluster set to node N or zone Z
//	hints-ignored=WHY           hints exist but were not used: missing-node-hint:ADDR,
//	                            no-node-hint-for:N, node-name-unknown, missing-zone-hint:ADDR,
//	                            no-zone-hint-for:Z, node-zone-unknown
//	hints=absent                trafficDistribution is set but no ready endpoint has hints
//	fallback=terminating        no ready endpoint: serving-terminating ones are used
//	endpoints=none|none-on-node nothing usable (none-on-node: usable ones exist elsewhere)
//	traffic=none                the port takes no external traffic (External only)
func selectEndpoints(p *service.Port, eps []service.Endpoint, node NodeTopology) EndpointSelection {
	external := p.ExternallyAccessible()
	// As kube-proxy: the Cluster set is needed for cluster-IP traffic under the Cluster policy
	// and for any external traffic (ExternalFromNode even under Local); the Local set under
	// either Local policy.
	usesCluster := !p.InternalLocal || external
	usesLocal := p.InternalLocal || (p.ExternalLocal && external)

	var out EndpointSelection
	var cluster, local Selection
	if usesCluster {
		cluster = clusterSelection(p, eps, node)
		out.HasAnyEndpoints = len(cluster.Endpoints) > 0
	}
	if usesLocal {
		var anywhere bool
		local, anywhere = localSelection(eps, node.Name)
		out.HasAnyEndpoints = out.HasAnyEndpoints || anywhere
	}

	out.Internal = cluster
	if p.InternalLocal {
		out.Internal = local
	}
	if !external {
		out.External = Selection{Reason: "traffic=none"}
		out.ExternalFromNode = out.External
		return out
	}
	out.External, out.ExternalFromNode = cluster, cluster
	if p.ExternalLocal {
		out.External = local
	}
	return out
}

// clusterSelection is the Cluster-policy set: ready endpoints narrowed by topology hints, else
// serving-terminating ones anywhere.
func clusterSelection(p *service.Port, eps []service.Endpoint, node NodeTopology) Selection {
	mode, tokens := topologyMode(p, eps, node)
	tokens = append([]string{"policy=Cluster"}, tokens...)
	var sel []netip.AddrPort
	for i := range eps {
		if eps[i].Ready && mode.admits(&eps[i]) {
			sel = append(sel, eps[i].Addr)
		}
	}
	// A topology mode is chosen only when it admits a ready endpoint, so an empty set here means
	// nothing is ready anywhere.
	if len(sel) == 0 {
		sel = servingTerminating(eps, func(*service.Endpoint) bool { return true })
		if len(sel) > 0 {
			tokens = append(tokens, "fallback=terminating")
		} else {
			tokens = append(tokens, "endpoints=none")
		}
	}
	return Selection{Endpoints: sel, Reason: joinTokens(tokens...)}
}

// localSelection is the Local-policy set: ready endpoints on this node, else serving-terminating
// ones on this node. anywhere reports whether a usable endpoint exists on any node.
func localSelection(eps []service.Endpoint, nodeName string) (sel Selection, anywhere bool) {
	isLocal := func(e *service.Endpoint) bool { return nodeName != "" && e.NodeName == nodeName }
	for i := range eps {
		e := &eps[i]
		if e.Ready || (e.Serving && e.Terminating) {
			anywhere = true
		}
		if e.Ready && isLocal(e) {
			sel.Endpoints = append(sel.Endpoints, e.Addr)
		}
	}
	sel.Reason = "policy=Local"
	if len(sel.Endpoints) == 0 {
		sel.Endpoints = servingTerminating(eps, isLocal)
		switch {
		case len(sel.Endpoints) > 0:
			sel.Reason = "policy=Local fallback=terminating"
		case anywhere:
			sel.Reason = "policy=Local endpoints=none-on-node"
		default:
			sel.Reason = "policy=Local endpoints=none"
		}
	}
	return sel, anywhere
}

func servingTerminating(eps []service.Endpoint, keep func(*service.Endpoint) bool) []netip.AddrPort {
	var out []netip.AddrPort
	for i := range eps {
		if e := &eps[i]; !e.Ready && e.Serving && e.Terminating && keep(e) {
			out = append(out, e.Addr)
		}
	}
	return out
}

// topology is how hints narrow the Cluster set: not at all, to one node, or to one zone.
type topology struct {
	node, zone string // at most one is set
}

func (t topology) admits(e *service.Endpoint) bool {
	switch {
	case t.node != "":
		return e.HasNodeHint(t.node)
	case t.zone != "":
		return e.HasZoneHint(t.zone)
	}
	return true
}

// topologyMode decides from the ready endpoints' hints whether to narrow the Cluster set, all or
// nothing: hints count only when every ready endpoint has one of the kind and at least one names
// this node (or zone), so a half-updated slice never strands traffic on a few endpoints. It also
// returns the tokens explaining the choice.
func topologyMode(p *service.Port, eps []service.Endpoint, node NodeTopology) (topology, []string) {
	var ready, withNodeHints, withZoneHints int
	var forNode, forZone bool
	var lacksNode, lacksZone netip.AddrPort // the first ready endpoint without such a hint
	for i := range eps {
		e := &eps[i]
		if !e.Ready {
			continue
		}
		ready++
		if len(e.NodeHints) > 0 {
			withNodeHints++
			forNode = forNode || e.HasNodeHint(node.Name)
		} else if !lacksNode.IsValid() {
			lacksNode = e.Addr
		}
		if len(e.ZoneHints) > 0 {
			withZoneHints++
			forZone = forZone || e.HasZoneHint(node.Zone)
		} else if !lacksZone.IsValid() {
			lacksZone = e.Addr
		}
	}
	if ready == 0 {
		return topology{}, nil
	}
	var tokens []string
	// Node hints first (PreferSameNode); a reason is given only when some were published.
	switch {
	case withNodeHints == ready && forNode:
		return topology{node: node.Name}, []string{"topology=node:" + node.Name}
	case withNodeHints == ready && node.Name == "":
		tokens = append(tokens, "hints-ignored=node-name-unknown")
	case withNodeHints == ready:
		tokens = append(tokens, "hints-ignored=no-node-hint-for:"+node.Name)
	case withNodeHints > 0:
		tokens = append(tokens, "hints-ignored=missing-node-hint:"+lacksNode.String())
	}
	switch {
	case withZoneHints == ready && forZone:
		return topology{zone: node.Zone}, append(tokens, "topology=zone:"+node.Zone)
	case withZoneHints == ready && node.Zone == "":
		tokens = append(tokens, "hints-ignored=node-zone-unknown")
	case withZoneHints == ready:
		tokens = append(tokens, "hints-ignored=no-zone-hint-for:"+node.Zone)
	case withZoneHints > 0:
		tokens = append(tokens, "hints-ignored=missing-zone-hint:"+lacksZone.String())
	case withNodeHints == 0 && p.TrafficDistribution != "":
		tokens = append(tokens, "hints=absent")
	}
	return topology{}, tokens
}

func joinTokens(tokens ...string) string { return strings.Join(tokens, " ") }
