package loadbalancer

import (
	"math/rand/v2"
	"net/netip"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// The algorithms as stored in Service.algo (an atomic, so a pick reads it without a lock).
const (
	algoRoundRobin uint32 = iota
	algoLeastConnections
	algoRandomTwoChoices
)

func algoCode(a service.Algorithm) uint32 {
	switch a {
	case service.LeastConnections:
		return algoLeastConnections
	case service.RandomTwoChoices:
		return algoRandomTwoChoices
	}
	return algoRoundRobin
}

func algoName(code uint32) service.Algorithm {
	switch code {
	case algoLeastConnections:
		return service.LeastConnections
	case algoRandomTwoChoices:
		return service.RandomTwoChoices
	}
	return service.RoundRobin
}

// pick chooses an endpoint of a non-empty set with the service port's algorithm, avoiding skip
// (the sticky endpoint a retry moves away from) when there is another.
func (s *Service) pick(set *endpointSet, skip *endpoint) *endpoint {
	switch s.algo.Load() {
	case algoLeastConnections:
		return s.leastConnections(set, skip)
	case algoRandomTwoChoices:
		return randomTwoChoices(set, skip)
	}
	n := uint64(len(set.eps))
	e := set.eps[(s.rr.Add(1)-1)%n]
	if e == skip && n > 1 {
		e = set.eps[(s.rr.Add(1)-1)%n]
	}
	return e
}

// leastConnections scans every endpoint for the fewest live flows: O(endpoints) atomic loads
// per pick, no lock (about 1 ns per endpoint; see BenchmarkPick). The scan starts one place
// further on each pick, so ties (all idle, typically) go round robin rather than to the first.
func (s *Service) leastConnections(set *endpointSet, skip *endpoint) *endpoint {
	n := uint64(len(set.eps))
	start := (s.rr.Add(1) - 1) % n
	var best *endpoint
	bestActive := int64(0)
	scan := func(eps []*endpoint) {
		for _, e := range eps {
			if e == skip {
				continue
			}
			if a := e.active.Load(); best == nil || a < bestActive {
				best, bestActive = e, a
			}
		}
	}
	scan(set.eps[start:])
	scan(set.eps[:start])
	if best == nil { // skip was the only endpoint
		best = set.eps[0]
	}
	return best
}

// randomTwoChoices draws two different endpoints and keeps the one with fewer live flows
// (Mitzenmacher's power of two choices: near least-connections balance at constant cost, and
// no herd onto one idle endpoint when many pickers see the same counts). math/rand/v2's
// top-level source is per-thread, so the draw takes no lock.
func randomTwoChoices(set *endpointSet, skip *endpoint) *endpoint {
	n := uint64(len(set.eps))
	if n == 1 {
		return set.eps[0]
	}
	i := rand.Uint64N(n)
	j := rand.Uint64N(n - 1)
	if j >= i {
		j++
	}
	a, b := set.eps[i], set.eps[j]
	switch {
	case a == skip:
		return b
	case b == skip:
		return a
	case b.active.Load() < a.active.Load():
		return b
	}
	return a
}

// SetBalancing sets a service port's balancing policy.
func (lb *LoadBalancer) SetBalancing(name service.ServicePortName, b service.Balancing) {
	lb.Service(name).setBalancing(b)
}

func (s *Service) setBalancing(b service.Balancing) {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	s.algo.Store(algoCode(b.Algorithm))
}

// Balancing returns the policy in force.
func (s *Service) Balancing() service.Balancing {
	return service.Balancing{Algorithm: algoName(s.algo.Load())}
}

// DialDone reports how a dial to ep, picked by Next, ended: err nil when it connected (the flow
// lives on until FlowDone), else the endpoint failed it (refused, timed out, reset) and the
// flow is over. The proxies call it through their Observer interface.
func (s *Service) DialDone(ep netip.AddrPort, err error) {
	if err == nil {
		return
	}
	if e := s.eps.Load().has[ep]; e != nil {
		e.release()
	}
}

// FlowDone reports the end of a flow on ep: a connection or session that connected, or a pick
// whose dial was abandoned for reasons that are not the endpoint's (shutdown, out of
// descriptors). reset says the endpoint cut the flow at once (a reset before any reply, an ICMP
// port unreachable).
func (s *Service) FlowDone(ep netip.AddrPort, reset bool) {
	if e := s.eps.Load().has[ep]; e != nil {
		e.release()
	}
}

// EndpointState is one endpoint as the balancer sees it, for the debug view.
type EndpointState struct {
	Endpoint netip.AddrPort
	// Active is the live flows counted on it (dials in progress, connections, sessions).
	Active int64
}

// EndpointStates lists the endpoints in round-robin order with their live state.
func (s *Service) EndpointStates() []EndpointState {
	set := s.eps.Load()
	out := make([]EndpointState, len(set.eps))
	for i, e := range set.eps {
		out[i] = EndpointState{Endpoint: e.addr, Active: e.active.Load()}
	}
	return out
}
