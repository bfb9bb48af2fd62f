package transparent

import (
	"net/netip"
	"slices"
	"sync/atomic"
)

// Policy decides, per connection or UDP session, whether the proxy dials the endpoint from the
// client's own address (transparent) or from its own. A transparent dial only works when the
// endpoint's replies to the client's address pass through this node, where the plumbing (Node)
// hands them to the proxy's socket:
//   - the client is a pod of this node (its address is in the node's pod CIDRs): every reply to
//     it is routed to this node, wherever the endpoint runs;
//   - or the endpoint is a pod of this node: its replies leave through this node (its default
//     route), whoever the client is (a NodePort client on another node, with
//     externalTrafficPolicy: Local).
//
// When both are pods of this node, a reply may be bridged straight from the endpoint to the
// client pod without being routed: it is caught only with the bridge part of the plumbing
// (Support.Bridge), else the proxy's address is used. Never transparent: a client or endpoint
// that is an address of this node (a host-network process: the kernel would answer it locally,
// and the client's port is its own socket's), a client that is its own endpoint (hairpin: a pod
// drops a packet from its own address), and addresses of different families.
//
// The data path calls Transparent for every new connection, so it reads one immutable snapshot
// through an atomic pointer; the setters publish a new one.
type Policy struct {
	s atomic.Pointer[policyState]
}

type policyState struct {
	off      bool // the plumbing is broken: nothing is transparent
	podCIDRs []netip.Prefix
	local    map[netip.Addr]struct{}
	bridge   bool
}

// NewPolicy returns a policy that says no to everything until it learns the node's pod CIDRs.
func NewPolicy() *Policy {
	p := &Policy{}
	p.s.Store(&policyState{})
	return p
}

// update publishes a copy of the current state changed by f. Setters are rare (a sync, a Node
// update), so copy-on-write costs nothing that matters.
func (p *Policy) update(f func(*policyState)) {
	for {
		old := p.s.Load()
		next := *old
		f(&next)
		if p.s.CompareAndSwap(old, &next) {
			return
		}
	}
}

// SetPodCIDRs sets this node's pod address ranges (Node.spec.podCIDRs, or --node-pod-cidr).
func (p *Policy) SetPodCIDRs(cidrs []netip.Prefix) {
	c := make([]netip.Prefix, 0, len(cidrs))
	for _, pfx := range cidrs {
		if pfx.IsValid() {
			c = append(c, pfx.Masked())
		}
	}
	p.update(func(s *policyState) { s.podCIDRs = c })
}

// PodCIDRs returns the pod CIDRs in use.
func (p *Policy) PodCIDRs() []netip.Prefix { return slices.Clone(p.s.Load().podCIDRs) }

// SetLocalAddrs sets the addresses of this node's own interfaces.
func (p *Policy) SetLocalAddrs(addrs []netip.Addr) {
	m := make(map[netip.Addr]struct{}, len(addrs))
	for _, a := range addrs {
		m[a.Unmap()] = struct{}{}
	}
	p.update(func(s *policyState) { s.local = m })
}

// SetBridge says whether replies bridged between two pods of this node reach the proxy
// (Support.Bridge of the last Sync).
func (p *Policy) SetBridge(ok bool) { p.update(func(s *policyState) { s.bridge = ok }) }

// SetEnabled turns the policy off (false) while the plumbing cannot be repaired, and on again.
func (p *Policy) SetEnabled(on bool) { p.update(func(s *policyState) { s.off = !on }) }

// Transparent reports whether a dial from client to endpoint may leave from the client's address.
func (p *Policy) Transparent(client, endpoint netip.Addr) bool {
	return p.s.Load().transparent(client.Unmap(), endpoint.Unmap())
}

func (s *policyState) transparent(client, endpoint netip.Addr) bool {
	if s.off || !client.IsValid() || !endpoint.IsValid() || client.Is4() != endpoint.Is4() || client == endpoint {
		return false
	}
	if client.IsLoopback() || endpoint.IsLoopback() || client.IsUnspecified() || client.IsMulticast() {
		return false
	}
	if _, ok := s.local[client]; ok {
		return false
	}
	if _, ok := s.local[endpoint]; ok {
		return false
	}
	clientPod, endpointPod := s.isPod(client), s.isPod(endpoint)
	switch {
	case clientPod && endpointPod:
		return s.bridge
	default:
		return clientPod || endpointPod
	}
}

func (s *policyState) isPod(a netip.Addr) bool {
	for _, pfx := range s.podCIDRs {
		if pfx.Contains(a) {
			return true
		}
	}
	return false
}
